"""The OpenAI completions and chat-completions protocol: request validation and response bodies.

Validation happens in the HTTP handler, before a request is queued, so a bad request never
reaches the engine and always gets a 400 that names the field (`param`) and says what to
change, in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.

Per-request sparsity rides in the body's extra field `sparsedecode`, the way vLLM takes
`vllm_xargs` through the client's `extra_body`:

    {"mode": "auto"}                                   the gate's choice (a gated server's default)
    {"mode": "both0.5/0.3"}                            a configuration by name (`SparsityConfig.parse`)
    {"proj_keep": 0.5, "kv": "snapkv", "kv_keep": 0.3} the same by its fields
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

MAX_STOPS = 4  # OpenAI's limit on `stop` sequences
SPARSITY_FIELDS = ("mode", "proj_keep", "kv", "kv_keep")
KV_KIND = {"snapkv": "sel", "window": "window"}


class RequestError(Exception):
    """A request the server refuses: HTTP status, message (what to change) and the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Params:
    """What one request asks of the engine, validated."""

    chat: bool
    prompt: object  # str, list of token ids, or the chat messages
    max_tokens: int | None  # None: a chat answer up to the rest of the cache
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    sparsity: str = "auto"  # 'auto' or a canonical mode string
    model: str = ""
    ignore_eos: bool = False  # vLLM's extra sampling field: decode max_tokens past an EOS


def _number(body: dict, name: str, default, lo: float, hi: float | None, *, lo_open=False, integer=False,
            where: str = ""):
    """body[name] checked to lie in [lo, hi] ((lo, hi] with lo_open); `where` prefixes the field."""
    v, param = body.get(name, default), where + name
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise RequestError(f"'{param}' must be {'an integer' if integer else 'a number'}, got {v!r}", param)
    if not math.isfinite(v) or (hi is not None and v > hi) or v < lo or (lo_open and v == lo):
        bound = f"{'>' if lo_open else '>='} {lo:g}" + ("" if hi is None else f" and <= {hi:g}")
        raise RequestError(f"'{param}' must be {bound}, got {v!r}", param)
    return v


def _sparsity(value) -> str:
    """The canonical configuration a request names ('auto' for the gate's choice)."""
    from sparsedecode.config import KVConfig, ProjectionConfig, SparsityConfig
    from sparsedecode.errors import InputError

    if value is None:
        return "auto"
    if not isinstance(value, dict):
        raise RequestError("'sparsedecode' must be an object such as {\"mode\": \"auto\"} or "
                           "{\"proj_keep\": 0.5, \"kv\": \"snapkv\", \"kv_keep\": 0.3}", "sparsedecode")
    unknown = sorted(set(value) - set(SPARSITY_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)} in 'sparsedecode': it takes "
                           f"{', '.join(SPARSITY_FIELDS)}", f"sparsedecode.{unknown[0]}")
    mode = value.get("mode")
    if mode is not None and len(value) > 1:
        raise RequestError("give 'sparsedecode.mode' or the fields proj_keep/kv/kv_keep, not both", "sparsedecode")
    try:
        if mode is not None:
            if not isinstance(mode, str):
                raise RequestError(f"'sparsedecode.mode' must be a string, got {mode!r}", "sparsedecode.mode")
            return "auto" if mode == "auto" else str(SparsityConfig.parse(mode))
        kv, kv_keep = value.get("kv"), value.get("kv_keep")
        if (kv is None) != (kv_keep is None):
            raise RequestError("the KV branch needs both 'kv' (snapkv or window) and 'kv_keep'", "sparsedecode.kv")
        if kv is not None and kv not in KV_KIND:
            raise RequestError(f"'sparsedecode.kv' must be one of {', '.join(KV_KIND)}, got {kv!r}", "sparsedecode.kv")
        proj = _number(value, "proj_keep", 1.0, 0.0, 1.0, lo_open=True, where="sparsedecode.")
        keep = _number(value, "kv_keep", 1.0, 0.0, 1.0, lo_open=True, where="sparsedecode.")
        return str(SparsityConfig(ProjectionConfig(keep=proj) if proj < 1.0 else None,
                                  KVConfig(kv, keep) if kv is not None and keep < 1.0 else None))
    except InputError as e:
        raise RequestError(str(e), "sparsedecode.mode") from None


def parse(body, *, chat: bool, model: str) -> Params:
    """Validate a completions (chat=False) or chat-completions body; raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model:
        raise RequestError(f"model '{name}' is not served here; this server runs '{model}'", "model",
                           status=404, kind="not_found_error")
    if chat:
        prompt = body.get("messages")
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
        for i, m in enumerate(prompt):
            if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                    or not isinstance(m.get("content"), str)):
                raise RequestError(f"messages[{i}] must be {{\"role\": system|user|assistant, \"content\": "
                                   f"string}}, got {m!r}"[:300], f"messages[{i}]")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        ok = isinstance(prompt, str) and prompt != "" or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                        and t >= 0 for t in prompt))
        if not ok:
            raise RequestError("'prompt' must be a non-empty string or a non-empty list of token ids "
                               "(batch 1: one prompt per request)", "prompt")
    tokens_field = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    # completions default to OpenAI's 16 tokens; a chat answer, to the rest of the cache (set later)
    max_tokens = _number(body, tokens_field, None if chat else 16, 1, None, integer=True)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings", "stop")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("'n' must be 1: the server decodes one sequence per request", "n")
    stream, ignore_eos = body.get("stream", False), body.get("ignore_eos", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", "stream")
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"'ignore_eos' must be true or false, got {ignore_eos!r}", "ignore_eos")
    return Params(
        chat=chat, prompt=prompt, max_tokens=max_tokens, stream=stream, stop=stop, model=model,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        sparsity=_sparsity(body.get("sparsedecode")), ignore_eos=ignore_eos,
    )


# -- responses ------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(p: Params, rid: str, text: str, finish: str, use: dict, extra: dict) -> dict:
    """The whole (non-streamed) response body."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
               "finish_reason": finish} if p.chat else
              {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if p.chat else "text_completion", "created": int(time.time()),
            "model": p.model, "choices": [choice], "usage": use, "sparsedecode": extra}


def chunk(p: Params, rid: str, text: str | None, finish: str | None = None, use: dict | None = None,
          extra: dict | None = None, first: bool = False) -> dict:
    """One server-sent event's body: a text delta, or (finish given) the last one with usage."""
    if p.chat:
        delta = {} if text is None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {"id": rid, "object": "chat.completion.chunk" if p.chat else "text_completion",
           "created": int(time.time()), "model": p.model, "choices": [choice]}
    if use is not None:
        out["usage"] = use
    if extra is not None:
        out["sparsedecode"] = extra
    return out

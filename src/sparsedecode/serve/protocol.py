"""The OpenAI completions and chat-completions protocol: request validation and response bodies.

Validation happens before a request is queued, so a bad request never reaches the engine and
always gets a 4xx that names the field (`param`) and says what to change, in OpenAI's error
shape `{"error": {"message", "type", "param", "code"}}`; `code` is a short reason that
`/metrics` counts refusals by. The body is read strictly: NaN/Infinity literals, lone
surrogates, nesting deeper than `MAX_DEPTH` and fields the server does not implement are
refused, never passed on or ignored. An OpenAI field the server does not implement is accepted
only at a value that asks for nothing (null or OpenAI's default, `UNSUPPORTED`); `null` for any
field means its default.

Per-request sparsity rides in the body's extra field `sparsedecode`, the way vLLM takes
`vllm_xargs` through the client's `extra_body`:

    {"mode": "auto"}                                   the gate's choice (a gated server's default)
    {"mode": "both0.5/0.3"}                            a configuration by name (`SparsityConfig.parse`)
    {"proj_keep": 0.5, "kv": "snapkv", "kv_keep": 0.3} the same by its fields
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

MAX_STOPS = 4  # OpenAI's limit on `stop` sequences
MAX_DEPTH = 32  # JSON nesting a request may use (a chat body needs 3)
SPARSITY_FIELDS = ("mode", "proj_keep", "kv", "kv_keep")
KV_KIND = {"snapkv": "sel", "window": "window"}
# the fields each endpoint implements: OpenAI's, vLLM's `ignore_eos` and our `sparsedecode`
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
          "ignore_eos", "sparsedecode")
FIELDS = {False: frozenset(COMMON + ("prompt",)), True: frozenset(COMMON + ("messages", "max_completion_tokens"))}
MESSAGE_FIELDS = ("role", "content")
# OpenAI fields the server does not implement, and the values that ask for nothing (besides null)
UNSUPPORTED = {
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,), "suffix": ("",), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True,),
}
# the OpenAI-style code of a refusal, by status, where the site names none
CODES = {400: "invalid_value", 404: "model_not_found", 413: "request_too_large", 415: "unsupported_media_type",
         429: "queue_full", 500: "server_error", 503: "shutting_down"}


class RequestError(Exception):
    """A request the server refuses: HTTP status, message (what to change), the field, and the
    short reason (`code`) it is counted under."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.code = code or CODES.get(status, "invalid_value")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        """The body as bytes; ASCII, so a lone surrogate a client sent can never fail to encode."""
        return json.dumps(self.body(), ensure_ascii=True).encode()


def _show(v, n: int = 80) -> str:
    """repr(v), cut to n characters (a value may be a 4000-digit integer or a long string)."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def load_json(raw: bytes, what: str):
    """The body's JSON value, read strictly (UTF-8, no NaN/Infinity); `what` names the field a
    body must hold, for the message."""
    hint = f": send a JSON object with {what}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not UTF-8 (byte {e.start}){hint}", code="invalid_json") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(f"the request body nests too deeply (at most {MAX_DEPTH} levels){hint}",
                           code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of more than 4300 digits
        reason = str(e).split(";")[0].replace("integer string conversion", "an integer")
        raise RequestError(f"the request body is not JSON ({reason}){hint}", code="invalid_json") from None


def check_tree(body) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings that are not Unicode text (a lone
    surrogate such as "\\ud800", which no tokenizer or UTF-8 encoder takes); iterative, so any
    depth json.loads returned is safe to walk."""
    stack = [(body, "", 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels (at {where})", where,
                               code="invalid_json")
        if isinstance(v, str):
            _text(v, where)
        elif isinstance(v, dict):
            for k, x in v.items():
                _text(k, where or "(a key)")
                stack.append((x, f"{where}.{k}" if where else k, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))


def _text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = where.encode("utf-8", "backslashreplace").decode("utf-8")
        raise RequestError(f"'{where}' is not valid Unicode: character {e.start} is a lone surrogate "
                           f"({s[e.start].encode('utf-8', 'backslashreplace').decode()}); send UTF-8 text",
                           where or None, code="invalid_unicode") from None


def _same(v, d) -> bool:
    """v equals the default d, types kept apart (false is not 0, "1" is not 1)."""
    if isinstance(v, bool) or isinstance(d, bool):
        return v is d
    if isinstance(d, (int, float)):
        return isinstance(v, (int, float)) and v == d
    return type(v) is type(d) and v == d


def _fields(body: dict, chat: bool) -> None:
    """Refuse a field the endpoint does not implement, unless its value asks for nothing."""
    for name, v in body.items():
        if v is None or name in FIELDS[chat]:
            continue
        if name in UNSUPPORTED:
            if any(_same(v, d) for d in UNSUPPORTED[name]):
                continue
            ok = " or ".join(["null", *(json.dumps(d) for d in UNSUPPORTED[name])])
            raise RequestError(f"'{name}' is not supported by this server (got {_show(v)}); leave it out or send "
                               f"{ok}", name, code="unsupported_parameter")
        other = FIELDS[not chat] - FIELDS[chat]
        hint = (f"; it belongs to {'/v1/completions' if chat else '/v1/chat/completions'}" if name in other else
                f"; this endpoint takes {', '.join(sorted(FIELDS[chat]))}")
        raise RequestError(f"unknown field '{name}'{hint}", name, code="unknown_parameter")


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {_show(v)}", name)
    return v


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
        raise RequestError(f"'{param}' must be {'an integer' if integer else 'a number'}, got {_show(v)}", param)
    # an int is compared as an int: math.isfinite would overflow on one of 400 digits
    if (isinstance(v, float) and not math.isfinite(v)) or (hi is not None and v > hi) or v < lo or (lo_open and v == lo):
        bound = f"{'>' if lo_open else '>='} {lo:g}" + ("" if hi is None else f" and <= {hi:g}")
        raise RequestError(f"'{param}' must be {bound}, got {_show(v)}", param)
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
                raise RequestError(f"'sparsedecode.mode' must be a string, got {_show(mode)}", "sparsedecode.mode")
            return "auto" if mode == "auto" else str(SparsityConfig.parse(mode))
        kv, kv_keep = value.get("kv"), value.get("kv_keep")
        if (kv is None) != (kv_keep is None):
            raise RequestError("the KV branch needs both 'kv' (snapkv or window) and 'kv_keep'", "sparsedecode.kv")
        if kv is not None and (not isinstance(kv, str) or kv not in KV_KIND):
            raise RequestError(f"'sparsedecode.kv' must be one of {', '.join(KV_KIND)}, got {_show(kv)}", "sparsedecode.kv")
        proj = _number(value, "proj_keep", 1.0, 0.0, 1.0, lo_open=True, where="sparsedecode.")
        keep = _number(value, "kv_keep", 1.0, 0.0, 1.0, lo_open=True, where="sparsedecode.")
        return str(SparsityConfig(ProjectionConfig(keep=proj) if proj < 1.0 else None,
                                  KVConfig(kv, keep) if kv is not None and keep < 1.0 else None))
    except InputError as e:
        raise RequestError(str(e), "sparsedecode.mode") from None


def parse(body, *, chat: bool, model: str) -> Params:
    """Validate a completions (chat=False) or chat-completions body (a `load_json` value);
    raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_tree(body)
    _fields(body, chat)
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"'model' must be a string, got {_show(name)}", "model")
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
                                   f"string}}, got {_show(m, 200)}", f"messages[{i}]")
            extra = sorted(k for k, v in m.items() if k not in MESSAGE_FIELDS and v is not None)
            if extra:
                raise RequestError(f"messages[{i}] has field '{extra[0]}', which this server does not implement; a "
                                   "message takes only 'role' and 'content'", f"messages[{i}].{extra[0]}",
                                   code="unsupported_parameter")
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
    both = chat and body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None
    if both:
        raise RequestError("give 'max_completion_tokens' or 'max_tokens', not both", "max_completion_tokens")
    tokens_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # completions default to OpenAI's 16 tokens; a chat answer, to the rest of the cache (set later)
    max_tokens = _number(body, tokens_field, None if chat else 16, 1, None, integer=True)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings", "stop")
    n = body.get("n")
    if n is not None and not _same(n, 1):
        raise RequestError(f"'n' must be 1: the server decodes one sequence per request (got {_show(n)})", "n")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"'user' must be a string, got {_show(user)}", "user")
    options = body.get("stream_options")  # usage rides in the last chunk whatever include_usage says
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError(f"'stream_options' must be {{\"include_usage\": true|false}}, got {_show(options)}",
                           "stream_options")
    return Params(
        chat=chat, prompt=prompt, max_tokens=max_tokens, stream=_flag(body, "stream"), stop=stop, model=model,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        sparsity=_sparsity(body.get("sparsedecode")), ignore_eos=_flag(body, "ignore_eos"),
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

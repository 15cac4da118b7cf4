"""What a generation returns (`Generation`), and how each sampled token reaches the host
(`HostToken`) while the next decode step is already queued (`Engine.tokens`' lookahead), and a
prompt's token ids (`encode`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class HostToken:
    """A sampled token's way to the host: on CUDA an asynchronous copy into pinned memory and
    an event, so that reading token i waits for its own step and not for step i+1 queued after."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buf = torch.empty(1, dtype=torch.long, pin_memory=True)
            self.done = torch.cuda.Event()

    def put(self, t: torch.Tensor) -> None:
        if self.cuda:
            self.buf.copy_(t.reshape(1), non_blocking=True)
            self.done.record()
        else:
            self.t = t

    def get(self) -> int:
        if self.cuda:
            self.done.synchronize()
            return int(self.buf[0])
        return int(self.t)


@dataclass
class Generation:
    """Result of `Engine.generate`: ids, text and wall-clock times in seconds."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_select_s: float = 0.0  # the KV branch's one-time observation, scoring and gather
    compile_s: float = 0.0  # compiling and capturing the decode step on the way (not in decode_s)
    stopped_at_eos: bool = False
    choice: object = None  # the runtime gate's dispatch.runtime.Choice for this request

    @property
    def ms_per_token(self) -> float:
        """Measured decode ms per step (1000 / decode_tok_s)."""
        tps = self.decode_tok_s
        return 1000.0 / tps if tps == tps and tps > 0 else float("nan")

    @property
    def prompt_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Decode steps per second (the first new token comes from the prefill)."""
        steps = max(len(self.ids) - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 and steps else float("nan")


def encode(tokenizer, prompt: str, chat: bool = False, name: str = "the model") -> list[int]:
    """Token ids of a prompt with `tokenizer`; with chat=True, wrapped in its chat template. Apart
    from `Engine` so that a prompt is counted before its model loads (`generate` sizes its cache)."""
    from sparsedecode.errors import InputError, option

    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(f"'{name}' has no chat template; drop {option('chat')}")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


__all__ = ["Generation", "HostToken", "encode"]

"""The configurations a server may run, warmed at start so that no request pays a compile.

A gated server (`--gate`) runs every configuration its gate admits; a request asks for 'auto'
(the gate's choice for its prompt and max_tokens, ByteCross §3.3) or names one of them. A server
started with one configuration (`--thresholds`/`--proj-keep`, `--kv`/`--kv-keep`, or none:
dense) runs only that one. Asking for a configuration the server did not warm up is a 400:
warming it on demand would charge that request a compile and a capture.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sparsedecode.serve.protocol import RequestError


@dataclass(frozen=True)
class Plan:
    """The configuration one request decodes under, and the gate's prediction (None without one)."""

    spec: str
    predicted_ms_per_token: float | None = None
    predicted_select_s: float | None = None


class Configurations:
    """What the server runs: a RuntimeGate's admissible set, or the engine's one configuration."""

    def __init__(self, engine, gate=None):
        self.engine, self.gate = engine, gate
        self.specs = list(gate.specs) if gate is not None else [str(engine.config)]
        self.default = "auto" if gate is not None else self.specs[0]

    def plan(self, asked: str, prompt_tokens: int, max_new: int) -> Plan:
        """The configuration for a request that asked for `asked` ('auto' or a mode string)."""
        if asked == "auto":
            if self.gate is None:
                return Plan(self.specs[0])
            c = self.gate.choose(prompt_tokens, max_new)
            return Plan(c.spec, c.predicted_ms_per_token, c.predicted_select_s)
        if asked not in self.specs:
            raise RequestError(
                f"configuration {asked} was not warmed up by this server (it runs {', '.join(self.specs)}"
                + (", or auto" if self.gate is not None else "") + "); ask for one of those, or start the "
                "server with a gate table or options that include it", "sparsedecode.mode")
        if self.gate is None:
            return Plan(asked)
        c = self.gate.choose(prompt_tokens, max_new, spec=asked)
        if math.isinf(c.predicted_ms_per_token):
            raise RequestError(self._too_short(asked, prompt_tokens, max_new), "sparsedecode.mode")
        return Plan(asked, c.predicted_ms_per_token, c.predicted_select_s)

    def _too_short(self, spec: str, n: int, max_new: int) -> str:
        price = self.gate.table.configs[spec]
        need = math.ceil((price.sinks + price.window + max_new) / price.mode.kv_keep)
        return (f"{spec} cannot select from a {n}-token prompt with {max_new} new tokens: its budget must hold "
                f"{price.sinks} sinks and a {price.window}-token window, so it needs a prompt of about {need} "
                "tokens; use a longer prompt or 'auto'")

    def install(self, spec: str) -> None:
        if self.gate is not None:
            self.gate.install(spec)

    def warm(self, progress=None) -> dict[str, float]:
        """Compile and capture every configuration's decode step now (seconds each)."""
        if self.gate is not None:
            return self.gate.warm(progress)  # nothing to capture on CPU
        from sparsedecode.dispatch.runtime import warm_step

        spec, kv, room = self.specs[0], self.engine.kv_config, 0
        if kv is not None and kv.keep < 1.0:
            from sparsedecode.kv.select import get_selector

            sel = get_selector(kv.method, **kv.params)
            room = sel.sinks + sel.window
        t0 = time.perf_counter()
        warm_step(self.engine, spec, room)
        out = {spec: time.perf_counter() - t0}
        if progress is not None:
            progress(spec, out[spec])
        return out

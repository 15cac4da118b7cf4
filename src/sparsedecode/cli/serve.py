"""`sparsedecode serve`: an OpenAI-compatible HTTP server, one model, one request at a time or up to
`--batch` in one decode step (sparsedecode.serve)."""

from __future__ import annotations

import time

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    COUNT_MAX,
    SECONDS_MAX,
    SEED_MAX,
    TOKENS,
    TOKENS_MAX,
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvKeepOpt,
    KvOpt,
    MaxLenOpt,
    ProjKeepOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
    bounded,
    out_file,
)


@app.command()
def serve(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Known name, HF folder, hub id or .gguf file."),
    gate: str = typer.Option(None, "--gate", help="Gate table (sparsedecode dispatch table): every request "
                             "decodes under the admissible configuration of least predicted cost, or the one it names. "
                             "With --batch B a table of batch B (dispatch table --batch B): the batch's projection is "
                             "the one it prices cheapest at B, and each request chooses its KV selection."),
    thresholds: ThresholdsOpt = None,
    proj_keep: ProjKeepOpt = None,
    kv: KvOpt = None,
    kv_keep: KvKeepOpt = None,
    adapter: AdapterOpt = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", callback=bounded(0, 65535), help="TCP port (0: any free port, printed at start)."),
    batch: int = typer.Option(1, "--batch", callback=bounded(1, 1024), help="Requests decoded together in one step "
                              "(continuous batching: a finished request's slot goes to the next queued one); 1: one at a time."),
    max_queue: int = typer.Option(64, "--max-queue", callback=bounded(1, 10**6), help="Requests that may wait for the engine; more get 429."),
    drain_timeout: float = typer.Option(25.0, "--drain-timeout", callback=bounded(0, 3600), metavar="SECONDS", help="Seconds SIGTERM/SIGINT let the running "
                                        "answer finish before it is stopped with a 503; queued requests get 503 at once."),
    max_len: MaxLenOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    attention: str = typer.Option("split_k", "--attention", help="split_k or sdpa_masked (the step is captured)."),
    init: str = typer.Option("pretrained", "--init", help="pretrained, or random (a config's dims, token-id prompts)."),
    text_file: TextFileOpt = None,
    threads: ThreadsOpt = None,
    ready_file: str = typer.Option(None, "--ready-file", callback=out_file(".json", new=True),
                                   help="Write a JSON of the start-up (address, seconds per phase and "
                                        "configuration) here once the server accepts requests."),
):
    """Serve /v1/completions and /v1/chat/completions (streamed or not), /v1/models, /health, /metrics."""
    from sparsedecode.cli.common import (
        apply_sparsity,
        apply_threads,
        check_adapter,
        check_calibration_text,
        check_engine_args,
        check_new_file,
        check_sparsity_args,
    )
    from sparsedecode.errors import InputError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise InputError(f"serve needs the [serve] extra ({e.name} is missing): pip install 'sparsedecode[serve]'") from None
    apply_threads(threads)
    check_engine_args(device, dtype, max_len, attention)
    if attention == "sdpa_fused":
        raise InputError("--attention sdpa_fused slices the cache on the host, so no decode step can be captured "
                         "ahead of requests; serve with split_k or sdpa_masked")
    if ready_file is not None:
        check_new_file(ready_file, "--ready-file", ".json")
    if batch > 1 and attention != "split_k":
        raise InputError(f"a decode batch attends with split_k: drop --attention {attention}, or serve with --batch 1")
    config, th, _ = check_sparsity_args(thresholds, proj_keep, kv, kv_keep, gate)
    check_calibration_text(text_file, calibrates=proj_keep is not None or gate is not None, init=init)
    lora = check_adapter(adapter)

    import socket

    import sparsedecode
    from sparsedecode.serve.app import Server
    from sparsedecode.serve.configs import Configurations

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # before the model loads: a taken port fails at once
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    t0 = time.perf_counter()
    eng = sparsedecode.load(model, device=device, dtype=dtype, max_len=max_len, attention=attention, init=init,
                            batch=batch, adapter=lora)
    apply_sparsity(eng, config, th, text_file=text_file)
    gate_obj = None
    if gate is not None:  # the server asks it per request itself (auto or named)
        from sparsedecode.dispatch.runtime import load_gate

        gate_obj = load_gate(eng, gate, progress=True, text_file=text_file)
    load_s = time.perf_counter() - t0
    server = Server(eng, Configurations(eng, gate_obj), max_queue=max_queue)
    typer.echo(f"[loaded {eng.name} on {eng.device}, {str(eng.dtype).removeprefix('torch.')}, cache {eng.max_len} "
               f"tokens" + (f" x {batch} slots" if batch > 1 else "") + f", in {load_s:.1f} s]", err=True)

    def shown(spec, s):
        typer.echo(f"  warmed {spec} in {s:.1f} s", err=True)

    t1 = time.perf_counter()
    warm = server.worker.start(shown)
    warm_s = time.perf_counter() - t1
    server.metrics.startup_seconds.labels("load").set(load_s)
    server.metrics.startup_seconds.labels("warm").set(warm_s)
    addr = sock.getsockname()
    url = f"http://{host}:{addr[1]}"
    typer.echo(f"[serving {eng.name} at {url}: configurations {', '.join(server.configs.specs)} "
               f"(default {server.configs.default}); start-up {load_s + warm_s:.1f} s "
               f"(load {load_s:.1f}, warm {warm_s:.1f})]", err=True)
    userver = server.uvicorn(drain_timeout)
    if ready_file is not None:
        record = {"url": url, "port": addr[1], "model": eng.name, "device": str(eng.device),
                  "configurations": server.configs.specs, "default": server.configs.default,
                  "load_s": load_s, "warm_s": warm_s, "warm_s_by_config": warm}
        _when_started(userver, lambda: _write(ready_file, record))
    userver.run(sockets=[sock])


def _when_started(userver, action) -> None:
    """Run `action` once uvicorn accepts connections."""
    startup = userver.startup

    async def wrapped(*args, **kwargs):
        await startup(*args, **kwargs)
        action()

    userver.startup = wrapped


def _write(path: str, record: dict) -> None:
    from sparsedecode.records import stamp, write_record

    write_record(path, stamp({"kind": "serve_startup", **record}))  # atomic: a reader never sees half


def _health(url: str) -> dict:
    """The running server's /health answer, or an InputError saying none answers."""
    import httpx

    from sparsedecode.errors import InputError

    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=10)
        resp.raise_for_status()
        return resp.json()
    except httpx.HTTPError as e:
        raise InputError(f"no server answers at {url}/health ({type(e).__name__}); start one with sparsedecode serve") from None


@app.command("serve-load")
def serve_load(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server's base URL."),
    clients: int = typer.Option(32, "--clients", callback=bounded(1, 4096), help="Concurrent clients."),
    requests: int = typer.Option(4, "--requests", callback=bounded(1, COUNT_MAX), help="Requests per client, one after another."),
    max_tokens: int = typer.Option(8, "--max-tokens", **TOKENS, help="max_tokens of each request."),
    prompt: str = typer.Option("The capital of France is", "--prompt", help="The prompt of every request."),
    pid: int = typer.Option(None, "--pid", callback=bounded(1, 2**31 - 1), help="The server's PID, to record its resident memory before and after."),
    timeout: float = typer.Option(600.0, "--timeout", callback=bounded(0, SECONDS_MAX, low_open=True), help="Seconds the whole run may take."),
    out: str = typer.Option(None, "--out", callback=out_file(".json", new=True), help="Write the record here (JSON)."),
    as_json: JsonOpt = False,
):
    """A bounded load test of a running server: every request must end in 200 or 429."""
    from sparsedecode.cli.common import check_new_file, emit_json
    from sparsedecode.serve.load import run_load

    if out is not None:
        check_new_file(out, "--out", ".json")
    _health(url)
    from tqdm import tqdm

    bar = tqdm(total=clients * requests, unit="req", disable=as_json)
    rec = run_load(url, clients=clients, requests=requests, max_tokens=max_tokens, prompt=prompt,
                   timeout_s=timeout, pid=pid, progress=lambda n: bar.update(n - bar.n))
    bar.close()
    if out is not None:
        import sys

        from sparsedecode.records import stamp, write_record

        write_record(out, stamp({"kind": "serve_load", "command": ["sparsedecode", *sys.argv[1:]], **rec},
                                with_torch=False))
    if as_json:
        emit_json(rec)
    else:
        lat = rec["latency_s"]
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        typer.echo(f"{rec['answered']} of {rec['sent']} answered: {rec['status_counts']}; p50 {fmt(lat['p50'])} s, "
                   f"p95 {fmt(lat['p95'])} s; {fmt(rec['requests_per_s'])} req/s, {fmt(rec['tokens_per_s'])} tok/s; "
                   f"server RSS {rec['server_rss_mb']['before']} -> {rec['server_rss_mb']['after']} MB")
    if not rec["ok"]:
        typer.echo(f"error: requests lost, errored or duplicated: {rec['errors']}", err=True)
        raise typer.Exit(1)


@app.command("serve-probe")
def serve_probe(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="The server's base URL."),
    request: list[str] = typer.Option(..., "--request", help="PROMPT:ANSWER tokens, e.g. 2K:256, repeatable."),
    mode: list[str] = typer.Option(..., "--mode", help="A configuration the server runs (dense, proj0.5, "
                                   "both0.5/0.3, ...) or auto; repeatable: every request runs under each."),
    cells: str = typer.Option(None, "--cells", help="Timing-cell folder (campaign run / bench cell records) of "
                              "the same machine: set each request's ms/token beside its cell's."),
    tolerance: float = typer.Option(0.05, "--tolerance", callback=bounded(0, 1, low_open=True, high_open=True), help="Largest |server / cell - 1| that passes."),
    vocab: int = typer.Option(32000, "--vocab", callback=bounded(1, TOKENS_MAX), help="Prompt token ids are drawn from [0, VOCAB)."),
    seed: int = typer.Option(0, "--seed", callback=bounded(0, SEED_MAX), help="Seed of the prompts' token ids."),
    out: str = typer.Option(None, "--out", callback=out_file(".json", new=True), help="Write the record here (JSON)."),
    as_json: JsonOpt = False,
):
    """Token-id requests under named configurations; with --cells, exit 1 when the server's
    ms/token misses its timing cell by more than --tolerance."""
    from pathlib import Path

    from sparsedecode.cli.common import check_new_file, emit_json, parse_requests
    from sparsedecode.config import SparsityConfig
    from sparsedecode.errors import InputError
    from sparsedecode.serve.probe import compare, probe

    reqs = parse_requests(request)
    modes = [m if m == "auto" else str(SparsityConfig.parse(m)) for m in mode]
    if cells is not None and not Path(cells).is_dir():
        raise InputError(f"--cells {cells}: no such folder of timing cells")
    if out is not None:
        check_new_file(out, "--out", ".json")
    server = _health(url)

    def show(r):
        if as_json:
            return
        if r["status"] != 200:
            typer.echo(f"{r['prompt_tokens']:>7,} + {r['max_tokens']} {r['asked']}: HTTP {r['status']}: {r['error']}")
            return
        pred = r.get("predicted_ms_per_token")
        typer.echo(f"{r['prompt_tokens']:>7,} + {r['max_tokens']} {r['asked']:<12} -> {r['mode']:<12} "
                   f"{r['ms_per_token']:.3f} ms/token" + ("" if pred is None else f" (gate predicted {pred:.3f})")
                   + f", prefill {r['prefill_ms'] / 1000:.2f} s, select {r['kv_select_ms']:.0f} ms")

    rows = probe(url, reqs, modes, vocab=vocab, seed=seed, progress=show)
    rec = {"url": url, "server": server, "rows": rows}
    if cells is not None:
        rec["comparison"] = compare(rows, cells, tolerance)
        if not as_json:
            for r in rows:
                cell = "no cell" if r["cell_ms_per_token"] is None else f"cell {r['cell_ms_per_token']:.3f}"
                ratio = "" if r["ratio"] is None else f" ({100 * (r['ratio'] - 1):+.1f}%)"
                typer.echo(f"  {r['prompt_tokens']:>7,} {r.get('mode', r['asked']):<12} {cell}{ratio}")
    if out is not None:
        import sys

        from sparsedecode.records import stamp, write_record

        write_record(out, stamp({"kind": "serve_probe", "command": ["sparsedecode", *sys.argv[1:]], **rec},
                                with_torch=False))
    if as_json:
        emit_json(rec)
    failed = [r for r in rows if r["status"] != 200]
    if failed or (cells is not None and not rec["comparison"]["passed"]):
        typer.echo("error: " + (f"{len(failed)} request(s) failed" if failed else
                                f"a request's ms/token is not within {100 * tolerance:g}% of its cell"), err=True)
        raise typer.Exit(1)

"""`sparsedecode serve`: an OpenAI-compatible HTTP server, one model, batch 1.

Each request decodes under the configuration the dispatch gate picks for its prompt length and
max_tokens (ByteCross §3.3), or the one it names in its `sparsedecode` extra field; every
configuration is compiled and captured at start, so no request pays a compile.

- protocol.py: request validation and OpenAI response bodies
- configs.py: the configurations a server runs, and their warm-up
- worker.py: the engine's thread and the FIFO queue
- app.py: the FastAPI routes
- metrics.py: Prometheus metrics
- load.py: a bounded load test of a running server (`sparsedecode serve-load`)
"""

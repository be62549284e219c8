"""What the Prometheus metrics cost: a scrape of each server's registry, and the per-request work
of `serve`'s ASGI wrapper (`inference/server/metrics.py`'s ObserveRequests) against the bare app.

    PYTHONPATH=src python bench/metrics.py [--requests 20000]

Prints one JSON line. No model runs: the engine is a stand-in with the attributes the collector
reads (a scrape reads the same numbers whatever the model), so the figures are the metrics' own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

from composer_jax.env.sandbox.runner import SandboxStats
from composer_jax.env.server.metrics import EnvMetrics
from composer_jax.inference.engine.prefix_cache import PrefixStats
from composer_jax.inference.server.metrics import ObserveRequests, ServeMetrics

TOOLS = ("read_file", "edit_file", "list_dir", "grep", "semantic_search", "run_shell")


def _engine() -> SimpleNamespace:
    sampler = SimpleNamespace(slots=16, slots_in_use=12)
    return SimpleNamespace(
        sampler=sampler,
        tokens_generated=10**6,
        prefix_stats=PrefixStats(100, 40, 5000, 9000),
        outstanding=20,
        version=7,
        swaps=7,
        steps=50_000,
        step_s=800.0,
        failures=0,
    )


def _per_call(f, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def _env_metrics() -> EnvMetrics:
    m = EnvMetrics()
    m.watch(lambda: 64, SandboxStats(started=10**5, running=12, failed={"setup": 1}, killed={"timeout": 30}))
    for tool in TOOLS:  # every tool's series, as a busy server has them
        m.tool_calls.labels(tool=tool, outcome="ok").inc()
        m.tool_call_seconds.labels(tool=tool).observe(0.01)
    for code in ("2xx", "4xx"):
        m.http_requests.labels(code=code).inc()
    return m


async def _asgi_cost(requests: int) -> tuple[float, float]:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    metrics = ServeMetrics(_engine(), model_name="m", max_len=4096, endpoints=["/v1/completions"])  # type: ignore[arg-type]
    wrapped = ObserveRequests(app, metrics)
    scope = {"type": "http", "path": "/v1/completions", "method": "POST"}
    out = []
    for handler in (app, wrapped):
        t0 = time.perf_counter()
        for _ in range(requests):
            await handler(scope, receive, send)
        out.append((time.perf_counter() - t0) / requests)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000, help="requests through each ASGI app (default 20000)")
    ap.add_argument("--scrapes", type=int, default=500, help="scrapes of each registry (default 500)")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.scrapes < 1:
        ap.error(f"--requests {args.requests} and --scrapes {args.scrapes} must be >= 1")
    serve = ServeMetrics(_engine(), model_name="m", max_len=4096, endpoints=["/v1/completions"])  # type: ignore[arg-type]
    env = _env_metrics()
    bare, wrapped = asyncio.run(_asgi_cost(args.requests))
    print(
        json.dumps(
            {
                "serve_scrape_ms": round(_per_call(serve.render, args.scrapes) * 1e3, 3),
                "serve_scrape_bytes": len(serve.render()),
                "env_scrape_ms": round(_per_call(env.render, args.scrapes) * 1e3, 3),
                "env_scrape_bytes": len(env.render()),
                "asgi_bare_us": round(bare * 1e6, 2),
                "asgi_observed_us": round(wrapped * 1e6, 2),
                "per_request_overhead_us": round((wrapped - bare) * 1e6, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

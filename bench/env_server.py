"""Environment-server benchmark: prints figures, never passes or fails.

    python bench/env_server.py [--tasks DIR] [--task fix-add] [--hold-levels 256 512] [--hold-seconds 60]

Starts `composer-jax env-server` (bubblewrap sandbox) as a subprocess and measures, over HTTP:
  1. session create latency, p50 / p99 (sequential creates, each session closed afterwards);
  2. tool calls per second with 64 concurrent sessions, for the file tools (read_file, grep,
     list_dir, edit_file, semantic_search in rotation) and for run_shell alone (one sandbox each);
  3. the largest number of concurrent sessions held for `--hold-seconds` with no error, each
     session issuing a tool call about once a second (a run_shell every tenth call).
Targets from issue 4: p50 create < 50 ms, >= 300 tool calls/s, 256 sessions.

The client shares the machine's cores with the server, so it must be cheap: the default is aiohttp
(HTTP/1.1 keep-alive, one pooled connection per concurrent request, ~0.2 ms of client CPU per
call). `--client httpx` is the previous client: its connection pool spends ~4 ms of CPU per call
with 64 connections in flight, which capped the figure at ~150 calls/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
FILE_CALLS = [
    ("read_file", {"path": "calc.py"}),
    ("grep", {"pattern": "def \\w+"}),
    ("list_dir", {}),
    ("edit_file", {"path": "notes.txt", "new_string": "benchmark\n"}),
    ("semantic_search", {"query": "sum of two numbers"}),
]


def start_server(tasks: Path, max_sessions: int) -> tuple[subprocess.Popen, str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "composer_jax.cli",
            "env-server",
            "--tasks",
            str(tasks),
            "--port",
            "0",
            "--max-sessions",
            str(max_sessions),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None  # a PIPE
    match = re.search(r"listening on (\S+) .*token=(\S+)", proc.stdout.readline())
    if not match:
        proc.kill()
        sys.exit("env-server did not start")
    return proc, match.group(1), match.group(2)


class Http:
    """The requests the benchmark makes, over aiohttp or httpx: (status, decoded JSON body)."""

    def __init__(self, kind: str, url: str, token: str):
        headers = {"Authorization": f"Bearer {token}"}
        self.kind, self.url = kind, url
        if kind == "aiohttp":
            self._aio = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=1024)
            )
        else:
            self._httpx = httpx.AsyncClient(
                base_url=url,
                headers=headers,
                timeout=120,
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
            )

    async def request(self, method: str, path: str, json: dict | None = None) -> tuple[int, dict]:
        if self.kind == "aiohttp":
            async with self._aio.request(method, self.url + path, json=json) as r:
                return r.status, await r.json(content_type=None)
        resp = await self._httpx.request(method, path, json=json)
        return resp.status_code, resp.json()

    async def close(self) -> None:
        await (self._aio.close() if self.kind == "aiohttp" else self._httpx.aclose())


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def create_latency(http: Http, task: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        status, body = await http.request("POST", "/sessions", {"task_id": task})
        times.append(time.perf_counter() - t)
        if status != 201:
            sys.exit(f"POST /sessions: {status} {body}")
        await http.request("DELETE", f"/sessions/{body['session_id']}")
    return times


async def throughput(http: Http, task: str, sessions: int, seconds: float, shell: bool) -> float:
    ids = [(await http.request("POST", "/sessions", {"task_id": task}))[1]["session_id"] for _ in range(sessions)]
    done, errors = 0, 0
    stop = time.monotonic() + seconds

    async def worker(i: int, sid: str):
        nonlocal done, errors
        k = i
        while time.monotonic() < stop:
            name, args = ("run_shell", {"command": "echo hi"}) if shell else FILE_CALLS[k % len(FILE_CALLS)]
            k += 1
            status, body = await http.request(
                "POST", f"/sessions/{sid}/tools", {"calls": [{"name": name, "arguments": args}]}
            )
            ok = status == 200 and body["results"][0]["ok"]
            done += ok
            errors += not ok

    start = time.monotonic()
    await asyncio.gather(*(worker(i, s) for i, s in enumerate(ids)))
    rate = done / (time.monotonic() - start)
    await asyncio.gather(*(http.request("DELETE", f"/sessions/{s}") for s in ids))
    if errors:
        print(f"    ({errors} failed calls)")
    return rate


async def hold(http: Http, task: str, sessions: int, seconds: float) -> tuple[int, int]:
    """(calls made, errors) holding `sessions` sessions open for `seconds`."""
    ids = []
    for _ in range(sessions):
        status, body = await http.request("POST", "/sessions", {"task_id": task})
        if status != 201:
            return 0, 1
        ids.append(body["session_id"])
    calls, errors = 0, 0
    stop = time.monotonic() + seconds

    async def worker(i: int, sid: str):
        nonlocal calls, errors
        await asyncio.sleep((i % 100) / 100)  # spread the load over the second
        k = 0
        while time.monotonic() < stop:
            name, args = ("run_shell", {"command": "ls"}) if k % 10 == 9 else FILE_CALLS[k % 3]
            k += 1
            try:
                status, body = await http.request(
                    "POST", f"/sessions/{sid}/tools", {"calls": [{"name": name, "arguments": args}]}
                )
                ok = status == 200 and body["results"][0]["ok"]
            except (TimeoutError, httpx.HTTPError, aiohttp.ClientError):
                ok = False
            calls += 1
            errors += not ok
            await asyncio.sleep(1.0)

    await asyncio.gather(*(worker(i, s) for i, s in enumerate(ids)))
    for sid in ids:
        errors += (await http.request("GET", f"/sessions/{sid}"))[0] != 200
    await asyncio.gather(*(http.request("DELETE", f"/sessions/{s}") for s in ids))
    return calls, errors


async def main(args) -> None:
    proc, url, token = start_server(args.tasks, max(args.hold_levels + [64]) + 8)
    http = Http(args.client, url, token)
    try:
        health = (await http.request("GET", "/health"))[1]
        print(
            f"server: sandbox={health['sandbox']} volumes={health['volumes']} cpus={os.cpu_count()} "
            f"client={args.client} load average={os.getloadavg()[0]:.1f}"
        )
        await create_latency(http, args.task, 5)  # warm-up
        lat = await create_latency(http, args.task, args.creates)
        print(
            f"session create latency over {len(lat)} creates: p50 {pct(lat, 0.5) * 1e3:.1f} ms, "
            f"p99 {pct(lat, 0.99) * 1e3:.1f} ms (mean {statistics.mean(lat) * 1e3:.1f} ms)"
        )
        rate = await throughput(http, args.task, 64, args.seconds, shell=False)
        print(f"tool calls/s at 64 concurrent sessions, file tools: {rate:.0f}")
        rate = await throughput(http, args.task, 64, args.seconds, shell=True)
        print(f"tool calls/s at 64 concurrent sessions, run_shell only: {rate:.0f}")
        best = 0
        for level in args.hold_levels:
            calls, errors = await hold(http, args.task, level, args.hold_seconds)
            print(f"held {level} sessions for {args.hold_seconds:.0f} s: {calls} tool calls, {errors} errors")
            if errors:
                break
            best = level
        print(
            f"largest number of sessions held for {args.hold_seconds:.0f} s with no error: {best}"
            f"{' (the largest level tried)' if best == max(args.hold_levels) else ''}"
        )
    finally:
        await http.close()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=Path, default=REPO / "tests" / "env" / "fixtures" / "tasks")
    p.add_argument("--task", default="fix-add")
    p.add_argument("--creates", type=int, default=200)
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each throughput run")
    p.add_argument("--hold-levels", type=int, nargs="+", default=[256, 512])
    p.add_argument("--hold-seconds", type=float, default=60.0)
    p.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp", help="HTTP client library")
    asyncio.run(main(p.parse_args()))

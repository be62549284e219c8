"""MCP on the environment server: what a tool call costs through `/mcp` next to the REST route.

    python bench/env_mcp.py [--tasks DIR] [--task fix-add] [--calls 300]

Starts `composer-jax env-server` (bubblewrap sandbox), opens one session each way and times
`--calls` sequential read_file calls, one in flight at a time (latency, not throughput:
bench/env_server.py measures that):
  1. REST: POST /sessions/{id}/tools (httpx, keep-alive);
  2. MCP JSON-RPC by hand: POST /mcp tools/call with Mcp-Session-Id (httpx, keep-alive);
  3. the `mcp` SDK's client: ClientSession.call_tool over streamable_http_client;
and the SDK's initialize (which opens the environment session) and exit (DELETE /mcp closes it).
Prints figures, never passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx
from env_server import start_server
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

REPO = Path(__file__).resolve().parents[1]
ARGS = {"path": "calc.py"}
ACCEPT = "application/json, text/event-stream"


def summary(name: str, seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return f"{name:<34} p50 {statistics.median(ms):6.2f} ms   p99 {p99:6.2f} ms   ({len(ms)} calls)"


def rest(url: str, headers: dict, task: str, n: int) -> list[float]:
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        sid = http.post("/sessions", json={"task_id": task}).json()["session_id"]
        body = {"calls": [{"name": "read_file", "arguments": ARGS}]}
        out = []
        for _ in range(n):
            t = time.perf_counter()
            assert http.post(f"/sessions/{sid}/tools", json=body).json()["results"][0]["ok"]
            out.append(time.perf_counter() - t)
        http.delete(f"/sessions/{sid}")
    return out


def raw_mcp(url: str, headers: dict, task: str, n: int) -> list[float]:
    with httpx.Client(base_url=url, headers={**headers, "Accept": ACCEPT}, timeout=60) as http:
        params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}
        init = http.post(
            f"/mcp?task_id={task}", json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}
        )
        session = {"Mcp-Session-Id": init.headers["mcp-session-id"]}
        out = []
        for i in range(n):
            call = {
                "jsonrpc": "2.0",
                "id": i + 1,
                "method": "tools/call",
                "params": {"name": "read_file", "arguments": ARGS},
            }
            t = time.perf_counter()
            assert not http.post("/mcp", json=call, headers=session).json()["result"]["isError"]
            out.append(time.perf_counter() - t)
        http.delete("/mcp", headers=session)
    return out


async def sdk(url: str, headers: dict, task: str, n: int) -> tuple[list[float], float, float]:
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        t0 = time.perf_counter()
        async with streamable_http_client(f"{url}/mcp?task_id={task}", http_client=http) as (r, w, _):
            async with ClientSession(r, w) as session:
                await session.initialize()
                init_s = time.perf_counter() - t0
                await session.list_tools()  # call_tool lists once to learn output schemas; not timed
                out = []
                for _ in range(n):
                    t = time.perf_counter()
                    assert not (await session.call_tool("read_file", ARGS)).isError
                    out.append(time.perf_counter() - t)
                t1 = time.perf_counter()
        return out, init_s, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=Path, default=REPO / "tests" / "env" / "fixtures" / "tasks")
    parser.add_argument("--task", default="fix-add")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    proc, url, token = start_server(args.tasks, 8)
    headers = {"Authorization": f"Bearer {token}"}
    try:
        print(summary("REST POST /sessions/{id}/tools", rest(url, headers, args.task, args.calls)))
        print(summary("MCP tools/call (httpx, by hand)", raw_mcp(url, headers, args.task, args.calls)))
        calls, init_s, exit_s = asyncio.run(sdk(url, headers, args.task, args.calls))
        print(summary("MCP SDK ClientSession.call_tool", calls))
        print(
            f"MCP SDK initialize (opens the session) {init_s * 1000:.1f} ms, exit (DELETE /mcp) {exit_s * 1000:.1f} ms"
        )
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()

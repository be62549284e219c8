"""EnvClient: load balancing over several servers, fail-over, typed errors for lost sessions."""

from __future__ import annotations

import asyncio
import socket

import pytest
from support.live_server import LiveServer, requires_bwrap

from composer_jax.env.api.client import EnvClient, RequestRejected, ServerUnavailable, SessionLost

pytestmark = requires_bwrap


def free_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_balancing_failover_and_session_lost():
    a = LiveServer()
    b = LiveServer("--token", a.token)  # both servers share the token

    async def scenario():
        async with EnvClient([free_url(), a.url, b.url], a.token, retries=1, backoff_s=0.01) as client:
            sessions = [await client.create_session("fix-add") for _ in range(4)]
            servers = sorted(s.server_url for s in sessions)
            assert servers == sorted([a.url, a.url, b.url, b.url])  # dead one skipped, rest balanced
            on_b = next(s for s in sessions if s.server_url == b.url)
            on_a = next(s for s in sessions if s.server_url == a.url)
            res = await on_b.call_tools([("run_shell", {"command": "echo ok"})])
            assert res[0]["result"]["stdout"] == "ok\n"
            with pytest.raises(RequestRejected) as info:
                await on_a.call_tools([("no_such_tool", {})])
            assert info.value.status == 400 and info.value.code == "unknown_tool"
            b.stop()
            with pytest.raises(SessionLost) as lost:
                await on_b.call_tools([("list_dir", {})])
            assert lost.value.server == b.url
            fresh = await client.create_session("fix-add")  # fails over to the live server
            assert fresh.server_url == a.url
            assert (await fresh.grade())["reward"] == 0.0
            for s in sessions + [fresh]:
                await s.close()
        async with EnvClient([free_url()], a.token, retries=1, backoff_s=0.01) as client:
            with pytest.raises(ServerUnavailable):
                await client.create_session("fix-add")

    try:
        asyncio.run(scenario())
    finally:
        a.stop()
        b.stop()

"""RemoteTokenPolicy against a live `serve` on the same weights as the in-process TokenPolicy: the
same tokens, log-probabilities (within 1e-5), versions and routed experts, turn after turn, greedy
and seeded; a stopped server or a closed engine raises SamplerUnavailable."""

from __future__ import annotations

import asyncio

import httpx
import jax
import numpy as np
import pytest
from support.serve_thread import CFG, KEY, MAX_LEN, TOK
from support.serve_thread import serve_in_thread as _serve

import composer_jax as cj
from composer_jax.inference.engine.asyncio_sampler import AsyncSampler
from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
from composer_jax.rl.samplers.in_process import TokenPolicy
from composer_jax.rl.samplers.policy import SamplerUnavailable, TurnRequest
from composer_jax.rl.samplers.serve import RemoteTokenPolicy

MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "fix calc.py"}]
TOOL = [{"role": "tool", "tool_call_id": "c1", "content": '{"path": "/app/calc.py"}'}]


@pytest.fixture(scope="module")
def params():
    return cj.init_params(CFG, jax.random.key(1))


async def _rollout(policy, requests: list[TurnRequest]):
    gen = policy.begin(MESSAGES)
    turns = []
    for i, req in enumerate(requests):
        if i:
            policy.extend(gen, TOOL)
        turns.append(await policy.turn(gen, req))
    return gen, turns


def test_remote_policy_records_what_the_in_process_policy_records(params):
    url, engine, http, thread = _serve(params)
    requests = [
        TurnRequest(max_tokens=10, seed=5),  # seeded sampling at T=1
        TurnRequest(max_tokens=8, seed=0, temperature=0.0),  # greedy
        TurnRequest(max_tokens=9, seed=11, temperature=0.7, top_p=0.9, top_k=50),
    ]
    try:

        async def go():
            local = TokenPolicy(
                AsyncSampler(Sampler(params, CFG, SamplerSettings(slots=2, max_len=MAX_LEN), version=3)), TOK
            )
            remote = RemoteTokenPolicy(url + "/v1", KEY, TOK, max_context=MAX_LEN)
            want = await _rollout(local, requests)
            got = await _rollout(remote, requests)
            health = await remote.health()
            await local.sampler.aclose()
            await remote.aclose()
            return want, got, health

        (want, want_turns), (got, got_turns), health = asyncio.run(go())
    finally:
        http.should_exit = True
        thread.join(10)
        engine.stop()
    # one request at a time on 2 slots: every decode step decoded exactly one (occupancy 1/2)
    assert health["slots"] == 2 and health["steps"] > 0 and health["slot_steps"] == health["steps"]
    assert health["step_s"] > 0 and health["policy_version"] == 3
    assert got_turns == want_turns and got.messages == want.messages
    assert got.tokens == want.tokens and got.loss_mask == want.loss_mask and got.generated == want.generated == 27
    assert got.versions == want.versions and set(got.versions) == {-1, 3}
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert want.routing is not None and got.routing is not None
    assert got.routing.shape == (len(got.tokens), 1, CFG.num_experts_per_tok)
    np.testing.assert_array_equal(got.routing, want.routing)


def test_dead_server_or_closed_engine_raises_sampler_unavailable(params):
    url, engine, http, thread = _serve(params)

    async def turn(policy):
        return await policy.turn(policy.begin(MESSAGES), TurnRequest(max_tokens=2, seed=1))

    try:
        policy = RemoteTokenPolicy(url, KEY, TOK, max_context=MAX_LEN)
        asyncio.run(turn(policy))  # serving
        too_long = RemoteTokenPolicy(url, KEY, TOK, max_context=MAX_LEN)
        with pytest.raises(ValueError, match=r"refused the request: HTTP 400.*max_tokens"):
            asyncio.run(too_long.turn(too_long.begin(MESSAGES), TurnRequest(max_tokens=MAX_LEN, seed=1)))
        engine.stop()  # the server answers, the engine does not: 503
        with pytest.raises(SamplerUnavailable, match=r"HTTP 503"):
            asyncio.run(turn(RemoteTokenPolicy(url, KEY, TOK, max_context=MAX_LEN)))
    finally:
        http.should_exit = True
        thread.join(10)
        engine.stop()
    with pytest.raises(SamplerUnavailable, match=r"ConnectError"):  # nothing listens any more
        asyncio.run(turn(RemoteTokenPolicy(url, KEY, TOK, max_context=MAX_LEN)))
    closed = RemoteTokenPolicy(url, KEY, TOK, max_context=MAX_LEN)
    asyncio.run(closed.aclose())
    with pytest.raises(SamplerUnavailable, match="closed"):
        asyncio.run(turn(closed))
    with pytest.raises(ValueError, match="base_url 'localhost:1'"):
        RemoteTokenPolicy("localhost:1", KEY, TOK, max_context=MAX_LEN)


@pytest.mark.parametrize(("drops", "ok"), [(2, True), (3, False)])
def test_a_dropped_connection_is_asked_again_then_the_replica_is_unavailable(drops, ok) -> None:
    """A connection the server closed under a request (a pooled keep-alive one) is retried on a new
    one, twice; a third drop in a row takes the replica for gone."""
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) <= drops:
            raise httpx.ReadError("connection closed by the server", request=request)
        return httpx.Response(200, json={"choices": []})

    async def go():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        policy = RemoteTokenPolicy("http://replica:1", KEY, TOK, max_context=MAX_LEN, http=http)
        try:
            return await policy._post({"prompt": [1, 2]})
        finally:
            await policy.aclose()

    if ok:
        assert asyncio.run(go()) == {"choices": []} and len(calls) == 3
    else:
        with pytest.raises(SamplerUnavailable, match=r"ReadError \(3 times\)"):
            asyncio.run(go())
        assert len(calls) == 3

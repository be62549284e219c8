"""The sampler-backend contract (rl/samplers/base.py), the same assertions against each backend:
the in-process sampler, a `composer-jax serve` replica (a live server in a thread, loading versions
from a file:// weight store), and a vLLM replica.

The vLLM row answers over HTTP from a recorded-shape stand-in of vLLM's routes (`/inference/v1/
generate`, `/update_weight_version`, `/health`, `/weight_info`) through `httpx.MockTransport`: a real
vLLM server takes minutes to start on CPU (tests/rl/test_vllm_sampler.py, slow), and vLLM's own
classes check the request bodies in tests/rl/test_vllm_policy.py. The stand-in checks what the
policy sends, answers only to the replica's API key (401 without it, as a launched replica does,
`GET /health` aside) and labels its tokens with the version it was last told, as vLLM does.

The contract: every policy keeps the `Generation` records (prompt tokens unmasked with version -1,
generated tokens masked in with their log-probabilities and the version that sampled them, routed
experts covering every position when there are any); after `publish` + `load` of a version, the
next turn is sampled by it; `health` answers; after `aclose` (twice: idempotent) a turn raises
SamplerUnavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from support.serve_thread import CFG, KEY, MAX_LEN, TOK, serve_in_thread

import composer_jax as cj
from composer_jax.inference.engine.asyncio_sampler import AsyncSampler
from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
from composer_jax.rl.samplers.base import SamplerBackend
from composer_jax.rl.samplers.in_process import InProcessSamplers, TokenPolicy
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable, TurnRequest
from composer_jax.rl.samplers.serve import ServeReplicas
from composer_jax.rl.samplers.vllm import GENERATE_PATH, VLLMReplicas, VLLMTokenPolicy
from composer_jax.weightsync.publisher import WeightPublisher

FIRST, NEXT = 3, 4  # the version the samplers start on, the one published
MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "fix calc.py"}]
TOOL = [{"role": "tool", "tool_call_id": "c1", "content": '{"path": "/app/calc.py"}'}]
REQ = TurnRequest(max_tokens=6, seed=5)
REPLICA_KEY = "replica-key-7"  # the vLLM row's API key

# a backend under test, and how the learner's weight store is written before `publish` (the
# learner publishes every version there first; only the serve replicas read it)
Row = tuple[SamplerBackend, Callable[[Any, int], object]]


@pytest.fixture(scope="module")
def weights():
    return cj.init_params(CFG, jax.random.key(1)), cj.init_params(CFG, jax.random.key(2))


def _sampler(params) -> Sampler:
    return Sampler(params, CFG, SamplerSettings(slots=2, max_len=MAX_LEN), version=FIRST)


@asynccontextmanager
async def in_process(weights, tmp_path) -> AsyncIterator[Row]:
    yield InProcessSamplers([TokenPolicy(AsyncSampler(_sampler(weights[0])), TOK)]), lambda params, v: None


@asynccontextmanager
async def serve(weights, tmp_path) -> AsyncIterator[Row]:
    """A live serve replica on 127.0.0.1 (tests/rl/test_remote_policy.py's), versions from a store."""
    url, engine, http, thread = serve_in_thread(weights[0], FIRST)
    store = f"file://{tmp_path}/weights"
    publisher = WeightPublisher(store)
    try:
        yield (
            ServeReplicas.connect([url], KEY, TOK, max_context=MAX_LEN, store_url=store),
            lambda params, v: publisher.publish(jax.tree.map(np.asarray, params), v),
        )
    finally:
        http.should_exit = True
        await asyncio.to_thread(thread.join, 10)
        engine.stop()


class FakeVLLM:
    """vLLM's routes as the policy uses them (module docstring): each generate answers 3 tokens, the
    last `<|im_end|>`, labelled with the weights' version; every route but `GET /health` wants the key."""

    def __init__(self) -> None:
        self.version = str(FIRST)
        self.stop = TOK.token_id("<|im_end|>")
        self.keyed: list[str] = []  # the routes asked with the key

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.headers.get("authorization") == f"Bearer {REPLICA_KEY}":
            self.keyed.append(path)
        elif path != "/health":
            return httpx.Response(401, json={"error": "Unauthorized"})
        if path == GENERATE_PATH:
            body = json.loads(request.content)
            sp = body["sampling_params"]
            assert sp["stop_token_ids"] == [self.stop] and sp["logprobs"] == 0 and sp["max_tokens"] == REQ.max_tokens
            tokens = [*TOK.encode("ok")[:2], self.stop]
            content = [{"token_id": t, "logprob": -0.5} for t in tokens]
            spans = [{"version": self.version, "start": 0, "end": len(tokens)}]
            choice = {"token_ids": tokens, "logprobs": {"content": content}, "weight_versions": spans}
            return httpx.Response(200, json={"choices": [choice]})
        if path == "/update_weight_version":
            self.version = json.loads(request.content)["new_version"]
            return httpx.Response(200, json={})
        if path == "/health":
            return httpx.Response(200)
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        return httpx.Response(404, text=path)


class LabelPush:
    """A weight push that only relabels the replica's weights (what NCCL's `/finish_weight_update`
    and a restart's `--version` end with); the weights themselves are recorded."""

    def __init__(self) -> None:
        self.exported: list[int] = []

    def export(self, params: Any, version: int) -> None:
        self.exported.append(version)

    def holding(self, version: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def load(self, policy: VLLMTokenPolicy, version: int) -> None:
        assert version in self.exported, "publish comes before load"
        resp = await policy.http.post(policy.base_url + "/update_weight_version", json={"new_version": str(version)})
        resp.raise_for_status()


@asynccontextmanager
async def vllm(weights, tmp_path) -> AsyncIterator[Row]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake := FakeVLLM()))
    push = LabelPush()
    policy = VLLMTokenPolicy(
        "http://replica:8000", TOK, max_context=MAX_LEN, weights=push, api_key=REPLICA_KEY, http=http
    )
    policy.version = FIRST
    yield VLLMReplicas([policy], push, together=True), lambda params, v: None
    assert {GENERATE_PATH, "/update_weight_version", "/weight_info"} <= set(fake.keyed)


BACKENDS = {"in_process": in_process, "serve": serve, "vllm": vllm}


def _check_turn(gen, before: int, version: int) -> int:
    """The records of one turn appended after `before` tokens; returns the tokens it generated."""
    n = len(gen.tokens) - before
    assert 0 < n <= REQ.max_tokens and gen.messages[-1]["role"] == "assistant"
    assert len(gen.loss_mask) == len(gen.logprobs) == len(gen.versions) == len(gen.tokens)
    assert gen.loss_mask[before:] == [1.0] * n and gen.versions[before:] == [version] * n
    assert all(np.isfinite(x) and x <= 0.0 for x in gen.logprobs[before:])
    assert all(0 <= t < TOK.vocab_size for t in gen.tokens[before:])
    assert gen.routing is None or gen.routing.shape[:2] == (len(gen.tokens), CFG.num_moe_layers)
    return n


@pytest.mark.parametrize("kind", list(BACKENDS))
def test_every_backend_keeps_the_contract(kind, weights, tmp_path) -> None:
    async def go() -> None:
        async with BACKENDS[kind](weights, tmp_path) as (backend, write_store):
            pool = PolicyPool(backend.policies)
            [policy] = backend.policies
            assert policy.max_context == MAX_LEN

            gen = policy.begin(MESSAGES)
            prompt = len(gen.tokens)
            assert prompt > 0 and gen.loss_mask == [0.0] * prompt and gen.versions == [-1] * prompt
            generated = _check_turn_after(await policy.turn(gen, REQ), gen, prompt, FIRST)

            before = len(gen.tokens)
            policy.extend(gen, TOOL)  # the environment's answer: in the context, trained on by nobody
            observed = len(gen.tokens) - before
            assert observed > 0 and gen.loss_mask[before:] == [0.0] * observed
            assert gen.versions[before:] == [-1] * observed

            write_store(weights[1], NEXT)
            await backend.publish(weights[1], NEXT)
            await backend.load(NEXT, pool)
            assert pool.alive == backend.policies  # every replica serves the version
            before = len(gen.tokens)
            generated += _check_turn_after(await policy.turn(gen, REQ), gen, before, NEXT)
            assert gen.generated == generated

            health = await backend.health()
            assert health and all(isinstance(h, dict) for h in health)

            await backend.aclose()
            await backend.aclose()  # idempotent
            with pytest.raises(SamplerUnavailable):
                await policy.turn(policy.begin(MESSAGES), REQ)

    asyncio.run(go())


def _check_turn_after(turn, gen, before: int, version: int) -> int:
    assert gen.messages[-1] == turn.message()
    return _check_turn(gen, before, version)

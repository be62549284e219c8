"""The token policy through the real sampler: over several turns the generation keeps the model's
own tokens, and every generated token's recorded log-probability equals the training forward's on
the whole context with the recorded routing replayed."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.live_env import REPO

import composer_jax as cj
from composer_jax.formats.chatml import parse_assistant, render_prompt
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.engine.asyncio_sampler import AsyncSampler
from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
from composer_jax.rl.samplers.in_process import TokenPolicy
from composer_jax.rl.samplers.policy import TurnRequest

TOK = load_tokenizer(REPO / "assets" / "tokenizer")
CFG = cj.ModelConfig(num_layers=2, num_mtp_layers=0, vocab_size=TOK.vocab_size, max_position_embeddings=256)


@pytest.fixture(scope="module")
def params():
    return cj.init_params(CFG, jax.random.key(1))


def test_token_policy_records_what_training_replays(params):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "fix calc.py"}]
    tool = [{"role": "tool", "tool_call_id": "c1", "content": '{"path": "/app/calc.py"}'}]

    async def go():
        policy = TokenPolicy(AsyncSampler(Sampler(params, CFG, SamplerSettings(slots=2, max_len=192))), TOK)
        gen = policy.begin(messages)
        first = await policy.turn(gen, TurnRequest(max_tokens=12, seed=5))
        n1 = gen.context_len()
        policy.extend(gen, tool)
        await policy.turn(gen, TurnRequest(max_tokens=12, seed=6))
        await policy.sampler.aclose()
        return gen, first, n1

    gen, first, n1 = asyncio.run(go())
    prompt = render_prompt(messages, TOK).tolist()
    assert gen.tokens[: len(prompt)] == prompt
    mask = np.asarray(gen.loss_mask)
    n = len(gen.tokens)
    assert len(mask) == len(gen.logprobs) == len(gen.versions) == n and gen.routing is not None
    assert gen.routing.shape == (n, 1, CFG.num_experts_per_tok)  # one MoE layer (first_k_dense=1)
    # turn 1: 12 tokens (a random model rarely stops), read back by the real parser
    assert mask[len(prompt) : n1].all() and mask.sum() == gen.generated
    assert first == parse_assistant(gen.tokens[len(prompt) : n1], TOK, call_id_prefix="call_2")
    assert not mask[n1 : n1 + 5].any()  # the continuation (tool message) is context, not a target
    assert set(np.asarray(gen.versions)[mask == 1]) == {0} and set(np.asarray(gen.versions)[mask == 0]) == {-1}

    seq = jnp.asarray([gen.tokens], jnp.int32)
    routing = jnp.asarray(gen.routing.transpose(1, 0, 2))[:, None]  # [layers, batch, seq, k]
    out = cj.forward(params, seq, CFG, routing=routing)
    lp = jax.nn.log_softmax(out.logits[0, :-1], axis=-1)
    chosen = np.asarray(jnp.take_along_axis(lp, seq[0, 1:, None], axis=-1)[:, 0])
    target = mask[1:] == 1  # position i predicts token i + 1
    np.testing.assert_allclose(np.asarray(gen.logprobs)[1:][target], chosen[target], atol=1e-5, rtol=0)
    # and the recorded routing is what the training forward picks unreplayed
    free = cj.forward(params, seq, CFG)
    np.testing.assert_array_equal(np.asarray(free.routing[:, 0, :-1]).transpose(1, 0, 2), gen.routing[:-1])

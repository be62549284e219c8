"""The continuous-batching sampler: its tokens, log-probabilities and recorded routing equal the
training forward's; staggered requests, in-flight weight updates, sampling settings, and the same
tokens on the fake 8-device mesh as on one device."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.token_sampling import SamplingParams, inverse_cdf, processed_logprobs

CFG = cj.ModelConfig(num_layers=2, num_mtp_layers=0, max_position_embeddings=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def params():
    return cj.init_params(CFG, jax.random.key(0))


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, n)]


def _training_view(params, completion):
    """The training forward over prompt + generated tokens: log-probs of the generated tokens and
    the routing of every token but the last (which the sampler never fed back)."""
    seq = jnp.asarray([completion.prompt + completion.tokens], jnp.int32)
    out = cj.forward(params, seq, CFG)
    n = len(completion.prompt)
    lp = jax.nn.log_softmax(out.logits[0, n - 1 : -1], axis=-1)
    chosen = jnp.take_along_axis(lp, seq[0, n:, None], axis=-1)[:, 0]
    return np.asarray(lp), np.asarray(chosen), np.asarray(out.routing[:, 0, :-1]).transpose(1, 0, 2)


def test_staggered_greedy_requests_equal_the_training_forward(params):
    # 5 requests of different prompt and output lengths through 2 slots: they join as others leave
    sampler = Sampler(params, CFG, SamplerSettings(slots=2, max_len=48))
    reqs = [
        Request(_prompt(i, n), dataclasses.replace(GREEDY, max_tokens=m))
        for i, (n, m) in enumerate([(5, 6), (11, 3), (3, 8), (17, 4), (8, 5)])
    ]
    done = sampler.run(reqs)
    assert [len(c.tokens) for c in done] == [6, 3, 8, 4, 5] and all(c.finish_reason == "length" for c in done)
    for c in done:
        lp, chosen, routing = _training_view(params, c)
        np.testing.assert_array_equal(np.argmax(lp, axis=-1), c.tokens)  # greedy under the full forward
        np.testing.assert_allclose(c.logprobs, chosen, atol=1e-5, rtol=0)
        assert c.routing is not None
        np.testing.assert_array_equal(c.routing, routing)  # what the training forward picks
        assert c.versions == [0] * len(c.tokens)
    # one decode program, and one prefill per (group, bucket) met: the first two prompts together
    # (2 rows of 16 tokens), later ones alone as slots free up (1 x 16, 1 x 32)
    assert sampler.compilations == 4


def test_a_group_prefill_with_a_padding_row_leaves_the_other_slots_alone(params):
    # slot 0 runs; three prompts then join together: a group of 4 rows, one of them padding, whose
    # writes must land nowhere (not in slot 3, the last real row)
    sampler = Sampler(params, CFG, SamplerSettings(slots=4, max_len=40))
    sampler.submit(Request(_prompt(20, 9), dataclasses.replace(GREEDY, max_tokens=8), id="first"))
    sampler.step()
    for i, n in enumerate([4, 13, 6]):
        sampler.submit(Request(_prompt(21 + i, n), dataclasses.replace(GREEDY, max_tokens=5), id=f"late{i}"))
    done = []
    while sampler.busy:
        done += sampler.step()
    assert sorted(c.id for c in done) == ["first", "late0", "late1", "late2"]
    for c in done:
        lp, chosen, routing = _training_view(params, c)
        np.testing.assert_array_equal(np.argmax(lp, axis=-1), c.tokens)
        np.testing.assert_allclose(c.logprobs, chosen, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(c.routing, routing)


def test_decode_chunks_give_the_one_step_samplers_tokens(params):
    # 5 staggered requests, greedy and sampled, through 2 slots with 4 decode steps per call; two
    # stop on a token: one on device (its stop id among the first STOP_IDS_ON_DEVICE), one only on
    # the host (its stop id the 9th), which drops the tokens after it
    def reqs(stops):
        return [
            Request(
                _prompt(30 + i, n),
                SamplingParams(temperature=(0.0, 1.0)[i % 2], max_tokens=m, seed=i, stop_token_ids=stops[i]),
            )
            for i, (n, m) in enumerate([(5, 9), (11, 3), (3, 8), (17, 6), (8, 5)])
        ]

    free = Sampler(params, CFG, SamplerSettings(slots=2, max_len=48)).run(reqs([()] * 5))
    far = tuple(t for t in range(100, 120) if t not in free[2].tokens)[:8]
    stops = [(free[0].tokens[2],), (), far + (free[2].tokens[4],), (), ()]
    one = Sampler(params, CFG, SamplerSettings(slots=2, max_len=48)).run(reqs(stops))
    chunked = Sampler(params, CFG, SamplerSettings(slots=2, max_len=48, decode_chunk=4))
    many = chunked.run(reqs(stops))
    assert [len(c.tokens) for c in one][0] <= 3 and len(one[2].tokens) <= 5
    assert one[0].finish_reason == one[2].finish_reason == "stop"
    for a, b in zip(one, many):
        assert (a.tokens, a.finish_reason, a.versions) == (b.tokens, b.finish_reason, b.versions)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(a.routing, b.routing)
    lp, chosen, routing = _training_view(params, many[4])  # greedy: also against the training forward
    np.testing.assert_array_equal(np.argmax(lp, axis=-1), many[4].tokens)
    np.testing.assert_allclose(many[4].logprobs, chosen, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(many[4].routing, routing)
    with pytest.raises(ValueError, match="decode_chunk=0"):
        Sampler(params, CFG, SamplerSettings(slots=1, max_len=16, decode_chunk=0))


def test_recorded_routing_replayed_in_training_gives_the_sampler_logprobs(params):
    sampler = Sampler(params, CFG, SamplerSettings(slots=1, max_len=32))
    (c,) = sampler.run([Request(_prompt(7, 6), SamplingParams(temperature=1.0, max_tokens=5, seed=3))])
    seq = jnp.asarray([c.prompt + c.tokens[:-1]], jnp.int32)
    assert c.routing is not None
    out = cj.forward(params, seq, CFG, routing=jnp.asarray(c.routing.transpose(1, 0, 2))[:, None])
    lp = jax.nn.log_softmax(out.logits[0, len(c.prompt) - 1 :], axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.asarray(c.tokens)[:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(c.logprobs, np.asarray(chosen), atol=1e-5, rtol=0)


def test_weight_swap_mid_generation(params):
    other = jax.tree.map(lambda x: x * 1.5, params)
    sampler = Sampler(params, CFG, SamplerSettings(slots=2, max_len=40))
    sampler.submit(Request(_prompt(1, 5), dataclasses.replace(GREEDY, max_tokens=10), id="a"))
    sampler.submit(Request(_prompt(2, 9), dataclasses.replace(GREEDY, max_tokens=4), id="b"))
    done = {c.id: c for c in sampler.step() + sampler.step() + sampler.step()}  # 4 tokens each so far
    sampler.update_weights(other, version=1)
    while sampler.busy:
        done.update({c.id: c for c in sampler.step()})
    a, b = done["a"], done["b"]
    assert len(a.tokens) == 10 and len(b.tokens) == 4  # nothing dropped or restarted
    assert a.versions == [0] * 4 + [1] * 6 and b.versions == [0] * 4
    # after the swap, a's tokens are the new weights' greedy choice over the kept cache: its 5th
    # token differs from what the old weights give (checked, not assumed: the swap took effect)
    (old_only,) = Sampler(params, CFG, SamplerSettings(slots=1, max_len=40)).run(
        [Request(_prompt(1, 5), dataclasses.replace(GREEDY, max_tokens=10))]
    )
    assert old_only.tokens[:4] == a.tokens[:4] and old_only.tokens != a.tokens


def test_same_seed_same_tokens_whatever_the_batch(params):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=11)
    (alone,) = Sampler(params, CFG, SamplerSettings(slots=1, max_len=32)).run([Request(_prompt(3, 4), p)])
    crowd = Sampler(params, CFG, SamplerSettings(slots=3, max_len=32)).run(
        [
            Request(_prompt(9, 7), dataclasses.replace(p, seed=1)),
            Request(_prompt(3, 4), p),
            Request(_prompt(8, 2), dataclasses.replace(p, seed=2)),
        ]
    )
    assert crowd[1].tokens == alone.tokens
    np.testing.assert_allclose(crowd[1].logprobs, alone.logprobs, atol=1e-6)


def test_processed_logprobs_by_hand():
    # logits ln(1), ln(2), ln(4): probabilities 1/7, 2/7, 4/7
    logits = jnp.log(jnp.asarray([[1.0, 2.0, 4.0]] * 4))
    lp = processed_logprobs(
        logits, jnp.asarray([1.0, 1.0, 1.0, 2.0]), jnp.asarray([0, 2, 0, 0]), jnp.asarray([1.0, 1.0, 0.5, 1.0])
    )
    p = np.exp(np.asarray(lp))
    np.testing.assert_allclose(p[0], [1 / 7, 2 / 7, 4 / 7], rtol=1e-6)
    np.testing.assert_allclose(p[1], [0, 1 / 3, 2 / 3], rtol=1e-6)  # top-2, renormalised: 2/6, 4/6
    np.testing.assert_allclose(p[2], [0, 0, 1], rtol=1e-6)  # 4/7 >= 0.5 alone
    # T = 2: probabilities proportional to sqrt(1), sqrt(2), sqrt(4) = 1, 1.414, 2
    z = 1 + math.sqrt(2) + 2
    np.testing.assert_allclose(p[3], [1 / z, math.sqrt(2) / z, 2 / z], rtol=1e-6)


def test_sampled_token_frequencies_follow_the_distribution(params):
    # 400 one-token requests at one context: frequencies of the top tokens against their probability
    prompt = _prompt(5, 4)
    logits = cj.forward(params, jnp.asarray([prompt], jnp.int32), CFG).logits[0, -1]
    probs = np.asarray(jax.nn.softmax(logits / 0.5))
    sampler = Sampler(params, CFG, SamplerSettings(slots=8, max_len=16))
    done = sampler.run([Request(prompt, SamplingParams(temperature=0.5, max_tokens=1, seed=s)) for s in range(400)])
    counts = np.bincount([c.tokens[0] for c in done], minlength=CFG.vocab_size)
    for t in np.argsort(-probs)[:3]:
        sd = math.sqrt(400 * probs[t] * (1 - probs[t]))
        assert abs(counts[t] - 400 * probs[t]) < 4 * sd + 1, (t, counts[t], 400 * probs[t])


def test_bad_requests_are_refused_with_the_reason(params):
    sampler = Sampler(params, CFG, SamplerSettings(slots=1, max_len=16))
    with pytest.raises(ValueError, match=r"prompt 10 \+ max_tokens 8 = 18 tokens exceeds the sampler's max_len=16"):
        sampler.submit(Request(_prompt(0, 10), dataclasses.replace(GREEDY, max_tokens=8)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.submit(Request([CFG.vocab_size + 3], GREEDY))
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        SamplingParams(top_p=1.5)


def test_sharded_sampler_gives_the_single_device_tokens(params):
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = cj.init_params(CFG, jax.random.key(0), mesh)
    reqs = [Request(_prompt(i, n), dataclasses.replace(GREEDY, max_tokens=4)) for i, n in enumerate([3, 6, 9, 4, 5])]
    ref = Sampler(params, CFG, SamplerSettings(slots=4, max_len=24)).run(reqs)
    got = Sampler(sharded, CFG, SamplerSettings(slots=4, max_len=24, mesh=mesh)).run(
        [Request(r.prompt, r.params) for r in reqs]
    )
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_filtered_sets_equal_a_numpy_sort():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 300)).astype(np.float32) * 3
    top_k = np.array([0, 1, 7, 0, 40, 300], np.int32)
    top_p = np.array([0.3, 1.0, 0.9, 0.95, 0.5, 1.0], np.float32)
    lp = np.asarray(processed_logprobs(jnp.asarray(logits), jnp.ones(6), jnp.asarray(top_k), jnp.asarray(top_p)))
    for r in range(6):
        probs = np.exp(logits[r].astype(np.float64) - logits[r].max())
        probs /= probs.sum()
        order = np.argsort(-probs)
        n_k = top_k[r] if top_k[r] > 0 else 300
        before = np.cumsum(probs[order]) - probs[order]
        n_p = int((before < top_p[r]).sum()) if top_p[r] < 1 else 300  # p = 1 keeps everything
        expected = set(order[: min(n_k, n_p)].tolist())
        assert set(np.flatnonzero(np.isfinite(lp[r])).tolist()) == expected, r
        kept = np.array(sorted(expected))
        np.testing.assert_allclose(np.exp(lp[r, kept]), probs[kept] / probs[kept].sum(), rtol=1e-5)


def test_inverse_cdf_equals_a_float64_search_and_never_picks_zero_mass():
    rng = np.random.default_rng(1)
    probs = rng.random((8, 1000)).astype(np.float32) ** 6
    probs[:, ::3] = 0.0
    probs[0, :] = 0.0
    probs[0, 517] = 0.25  # a single entry with mass: every u picks it
    probs[1, 990:] = 0.0  # trailing zeros: u = 1 picks the last entry with mass, 989
    u = np.concatenate([[1.0, 1.0], rng.random(6)]).astype(np.float32)
    probs[2, 1] = 1.0
    u[2] = np.float32(1e-9)  # the first entry with mass (entry 0 has none)
    got = np.asarray(inverse_cdf(jnp.asarray(probs), jnp.asarray(u)))
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    expected = np.array([np.searchsorted(cdf[r], u[r] * cdf[r, -1]) for r in range(8)])
    np.testing.assert_array_equal(got, expected)
    assert got[0] == 517 and got[1] == 989 and got[2] == 1
    assert (probs[np.arange(8), got] > 0).all()
    # many draws per row: never an entry without mass, and every pick is the float64 answer where
    # the target is not within rounding of a boundary
    us = rng.random(400).astype(np.float32)
    for r in range(1, 8):
        picks = np.asarray(inverse_cdf(jnp.broadcast_to(jnp.asarray(probs[r]), (400, 1000)), jnp.asarray(us)))
        assert (probs[r, picks] > 0).all()
        targets = us.astype(np.float64) * cdf[r, -1]
        clear = np.min(np.abs(cdf[r][None, :] - targets[:, None]), axis=1) > 1e-5 * cdf[r, -1]
        np.testing.assert_array_equal(picks[clear], np.searchsorted(cdf[r], targets[clear]))


def test_inverse_cdf_over_a_vocabulary_sharded_axis_has_no_vocabulary_wide_window():
    """A cumulative sum over a vocabulary-sharded axis compiles to a reduce-window as wide as the
    vocabulary (O(V^2): the in-process RL sampler with tensor=2 took minutes per token); the
    bisection compiles to reductions, and gives the single-device tokens."""
    mesh = jax.make_mesh((2,), ("t",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    rng = np.random.default_rng(2)
    probs = (rng.random((4, 4096)).astype(np.float32) ** 4) * (rng.random((4, 4096)) > 0.5)
    u = rng.random(4).astype(np.float32)
    sharded = jax.device_put(
        jnp.asarray(probs), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "t"))
    )
    compiled = jax.jit(inverse_cdf).lower(sharded, jnp.asarray(u)).compile()
    windows = {int(w.split("x")[-1]) for w in re.findall(r"window=\{size=([0-9x]+)", compiled.as_text())}
    assert max(windows, default=0) < 4096 // 2, windows  # XLA:CPU reduces in tiles of 32; the cumsum's window is 4096
    np.testing.assert_array_equal(
        np.asarray(compiled(sharded, jnp.asarray(u))), np.asarray(inverse_cdf(jnp.asarray(probs), jnp.asarray(u)))
    )

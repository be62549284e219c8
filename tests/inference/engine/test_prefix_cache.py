"""Prefix KV reuse in the sampler (`Sampler(prefix_cache=...)`): a request that continues an earlier
one's conversation reuses the cached prefix and gets what a sampler without reuse gives (tokens,
log-probabilities, routing of every position), for MLA with YaRN and for GQA; misses, partial
matches, continuous batching, weight swaps; the counters against hand-worked numbers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.small_models import gqa, mla_yarn

import composer_jax as cj
from composer_jax.inference.engine.batch_sampler import Completion, Request, Sampler, SamplerSettings
from composer_jax.inference.engine.token_sampling import SamplingParams

BASE = cj.ModelConfig(num_layers=2, num_mtp_layers=0, max_position_embeddings=64)
CONFIGS = {
    "mla_yarn": mla_yarn(BASE),
    "gqa": gqa(BASE),
}


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, BASE.vocab_size, n)]


@pytest.fixture(scope="module")
def params():
    return cj.init_params(BASE, jax.random.key(0))


def _same(got: Completion, ref: Completion) -> None:
    assert got.prompt == ref.prompt and got.tokens == ref.tokens
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert got.routing is not None and ref.routing is not None
    assert got.routing.shape == (len(got.prompt) + len(got.tokens) - 1, *ref.routing.shape[1:])
    np.testing.assert_array_equal(got.routing, ref.routing)


def _run_turns(sampler: Sampler, turns: list[list[Request]]) -> list[Completion]:
    """Each turn's requests through `sampler` to the end, one turn after the other."""
    return [c for reqs in turns for c in sampler.run(reqs)]


# mla_yarn in the full suite only: the [gqa] case keeps the reuse property by default (one cache code
# path for both attentions) and the only default GQA decode; test_sampler.py keeps MLA decoding
SLOW = {"mla_yarn"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CONFIGS)])
def test_a_second_turn_reuses_the_first_and_equals_a_fresh_prefill(name):
    cfg = CONFIGS[name]
    params = cj.init_params(cfg, jax.random.key(1))
    first = Request(_prompt(1, 9), _greedy(5))
    on, off = (
        Sampler(params, cfg, SamplerSettings(slots=2, max_len=48)),
        Sampler(params, cfg, SamplerSettings(slots=2, max_len=48, prefix_cache="none")),
    )
    (a,) = on.run([first])
    (a_ref,) = off.run([Request(first.prompt, first.params)])
    _same(a, a_ref)
    # the next turn: the whole conversation so far plus a tool's output (4 tokens)
    second = a.prompt + a.tokens + _prompt(2, 4)
    (b,) = on.run([Request(second, _greedy(6))])
    (b_ref,) = off.run([Request(second, _greedy(6))])
    _same(b, b_ref)
    # and what the training forward gives over the whole sequence (an independent reference)
    seq = jnp.asarray([b.prompt + b.tokens], jnp.int32)
    out = cj.forward(params, seq, cfg)
    lp = jax.nn.log_softmax(out.logits[0, len(second) - 1 : -1], axis=-1)
    np.testing.assert_array_equal(np.argmax(lp, axis=-1), b.tokens)
    np.testing.assert_array_equal(b.routing, np.asarray(out.routing[:, 0, :-1]).transpose(1, 0, 2))
    # the cache holds the 9 prompt tokens and the 4 generated ones fed back (not the 5th): 13 of
    # the 18 prompt tokens are reused, 5 prefilled (the last generated token and the tool's 4)
    assert on.prefix_stats.as_dict() == {
        "admitted": 2,
        "hits": 1,
        "reused": 13,
        "prefilled": 9 + 5,
        "hit_rate": 13 / 27,
    }
    assert off.prefix_stats.reused == 0 and off.prefix_stats.prefilled == 9 + 18
    # one decode program and one prefill (1 row x 16): the second turn's 5 tokens fit the first's
    # bucket; without reuse its 18 tokens need a 32-token bucket, a second prefill program
    assert (on.compilations, off.compilations) == (2, 3)


def test_misses_partial_matches_and_the_end_of_the_cache(params):
    on, off = (
        Sampler(params, BASE, SamplerSettings(slots=2, max_len=48)),
        Sampler(params, BASE, SamplerSettings(slots=2, max_len=48, prefix_cache="none")),
    )
    a_prompt = _prompt(10, 10)
    b_prompt = _prompt(11, 7)
    assert a_prompt[0] != b_prompt[0]
    turns = [
        [Request(a_prompt, _greedy(4))],  # slot 0 (both free, never used: the first); caches 10 + 3
        [Request(b_prompt, _greedy(3))],  # a miss: the least recently used free slot, 1; caches 7 + 2
        [Request(a_prompt[:6] + _prompt(12, 5), _greedy(4))],  # shares 6 tokens with slot 0's prefix
        [Request(a_prompt[:6] + _prompt(12, 5), _greedy(2))],  # the same prompt: all but its last token
    ]
    got, ref = _run_turns(on, turns), _run_turns(off, turns)
    for g, r in zip(got, ref, strict=True):
        _same(g, r)
    st = on.prefix_stats
    assert (st.admitted, st.hits, st.reused, st.prefilled) == (4, 2, 6 + 10, 10 + 7 + 5 + 1)
    # a long continuation whose 4 new tokens' bucket (16) would run past the cache's end (48):
    # the reuse stops at 48 - 16 = 32 positions, the other 12 of 44 are prefilled
    long_first = Request(_prompt(13, 30), _greedy(11))
    (c,) = on.run([long_first])
    (c_ref,) = off.run([Request(long_first.prompt, long_first.params)])
    _same(c, c_ref)
    cont = c.prompt + c.tokens + _prompt(14, 3)  # 44 tokens, 40 of them cached
    (d,) = on.run([Request(cont, _greedy(4))])
    (d_ref,) = off.run([Request(cont, _greedy(4))])
    _same(d, d_ref)
    assert (st.reused, st.prefilled) == (16 + 0 + 32, 23 + 30 + 12)


def test_staggered_continuation_with_a_group_of_different_prefixes(params):
    # three first turns through 2 slots, then their continuations (and a new conversation) arrive
    # together: two reuse their slots' prefixes in one group prefill, the rest wait and miss
    first = [Request(_prompt(20 + i, n), _greedy(m)) for i, (n, m) in enumerate([(7, 4), (12, 6), (5, 3)])]
    on, off = (
        Sampler(params, BASE, SamplerSettings(slots=2, max_len=48)),
        Sampler(params, BASE, SamplerSettings(slots=2, max_len=48, prefix_cache="none")),
    )
    done = on.run(first)
    for g, r in zip(done, off.run([Request(q.prompt, q.params) for q in first]), strict=True):
        _same(g, r)
    a, b, c = done
    sampled = SamplingParams(temperature=1.0, max_tokens=5, seed=7)
    second = [
        Request(b.prompt + b.tokens + _prompt(30, 3), _greedy(5)),
        Request(c.prompt + c.tokens + _prompt(31, 6), sampled),
        Request(a.prompt + a.tokens + _prompt(32, 2), _greedy(3)),  # a's slot went to c: a miss
        Request(_prompt(33, 8), _greedy(4)),
    ]
    assert len({q.prompt[0] for q in second[2:]} | {b.prompt[0], c.prompt[0]}) == 4
    before = dataclasses.replace(on.prefix_stats)
    got = on.run(second)
    ref = off.run([Request(q.prompt, q.params) for q in second])
    for g, r in zip(got, ref, strict=True):
        _same(g, r)
    st = on.prefix_stats
    # b reuses 12 + 5, c 5 + 2; a's continuation and the new prompt find only other prefixes
    assert st.hits - before.hits == 2 and st.reused - before.reused == 17 + 7
    assert st.prefilled - before.prefilled == sum(len(q.prompt) for q in second) - 17 - 7


def test_a_weight_swap_drops_the_cached_prefixes_unless_kept(params):
    other = jax.tree.map(lambda x: x * 1.5, params)
    first = Request(_prompt(40, 9), _greedy(3))
    follow = lambda c: c.prompt + c.tokens + _prompt(41, 2)
    version, keep = (
        Sampler(params, BASE, SamplerSettings(slots=1, max_len=32)),
        Sampler(params, BASE, SamplerSettings(slots=1, max_len=32, prefix_cache="keep")),
    )
    (a,) = version.run([first])
    (k,) = keep.run([Request(first.prompt, first.params)])
    version.update_weights(other, 1)
    keep.update_weights(other, 1)
    (b,) = version.run([Request(follow(a), _greedy(3))])
    (b_ref,) = Sampler(other, BASE, SamplerSettings(slots=1, max_len=32, prefix_cache="none")).run(
        [Request(follow(a), _greedy(3))]
    )
    _same(b, b_ref)  # the whole prompt under the new weights, as a fresh prefill
    assert version.prefix_stats.reused == 0
    keep.run([Request(follow(k), _greedy(3))])
    assert keep.prefix_stats.reused == 9 + 2  # the old weights' KV, reused
    # a request running across a swap leaves a prefix of mixed weights: not kept by default
    version.submit(Request(_prompt(42, 5), _greedy(4)))
    version.step()
    version.update_weights(params, 2)
    done: list[Completion] = []
    while version.busy:
        done += version.step()
    (c,) = done
    version.run([Request(follow(c), _greedy(2))])
    assert version.prefix_stats.reused == 0


def test_cancelled_requests_leave_a_reusable_prefix_and_bad_modes_are_refused(params):
    sampler = Sampler(params, BASE, SamplerSettings(slots=1, max_len=32))
    prompt = _prompt(50, 6)
    sampler.submit(Request(prompt, _greedy(8), id="x"))
    sampler.step()
    sampler.step()  # 3 tokens generated (one by the prefill, two by decode steps), 2 fed back
    (tokens, _, _) = sampler.running()["x"]
    generated = list(tokens)
    assert sampler.cancel("x")
    (c,) = sampler.run([Request(prompt + generated + [1, 2], _greedy(2))])
    (ref,) = Sampler(params, BASE, SamplerSettings(slots=1, max_len=32, prefix_cache="none")).run(
        [Request(prompt + generated + [1, 2], _greedy(2))]
    )
    _same(c, ref)
    assert sampler.prefix_stats.reused == 6 + 2  # the prompt and the 2 tokens fed back
    with pytest.raises(ValueError, match=r"prefix_cache='on' is not accepted; accepted: none, version, keep"):
        Sampler(params, BASE, SamplerSettings(slots=1, max_len=32, prefix_cache="on"))


# slow (15 s of the default suite's compiling): tests/inference/engine/test_sampler.py's
# test_sharded_sampler_gives_the_single_device_tokens keeps the sharded sampler's equality to one
# device, and this module's single-device tests keep the prefix cache's reuse, by default
@pytest.mark.slow
def test_a_sharded_sampler_reuses_like_the_single_device_one(params):
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = cj.init_params(BASE, jax.random.key(0), mesh)
    first = Request(_prompt(60, 7), _greedy(4))
    got_sampler = Sampler(sharded, BASE, SamplerSettings(slots=2, max_len=32, mesh=mesh))
    (a,) = got_sampler.run([first])
    (b,) = got_sampler.run([Request(a.prompt + a.tokens + _prompt(61, 3), _greedy(3))])
    ref = Sampler(params, BASE, SamplerSettings(slots=2, max_len=32, prefix_cache="none"))
    for got, want in zip([a, b], _run_turns(ref, [[first], [Request(b.prompt, _greedy(3))]]), strict=True):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_array_equal(got.routing, want.routing)
    assert got_sampler.prefix_stats.reused == 7 + 3


def test_decode_chunks_leave_the_same_reusable_prefix(params):
    # several decode steps per call: a slot that stops inside a chunk (max_tokens or a stop id) goes
    # idle on device; its cached prefix is still the prompt and its tokens but the last
    chunked = Sampler(params, BASE, SamplerSettings(slots=2, max_len=48, decode_chunk=3))
    ref = Sampler(params, BASE, SamplerSettings(slots=2, max_len=48, prefix_cache="none"))
    (probe,) = ref.run([Request(_prompt(70, 8), _greedy(7))])
    stop = SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[probe.tokens[4]])
    first = [Request(_prompt(70, 8), stop), Request(_prompt(71, 6), _greedy(5))]
    done = chunked.run(first)
    assert done[0].finish_reason == "stop" and len(done[0].tokens) <= 5
    second = [Request(c.prompt + c.tokens + _prompt(72 + j, 3), _greedy(4)) for j, c in enumerate(done)]
    got = chunked.run(second)
    for g, r in zip(got, ref.run([Request(q.prompt, q.params) for q in second]), strict=True):
        _same(g, r)
    assert chunked.prefix_stats.reused == sum(len(c.prompt) + len(c.tokens) - 1 for c in done)

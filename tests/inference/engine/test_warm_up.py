"""`Sampler.warm_up`: every admission program compiled before the first request, nothing else changed."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.token_sampling import SamplingParams

BASE = cj.ModelConfig(num_layers=2, num_mtp_layers=0, max_position_embeddings=64)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, BASE.vocab_size, n)]


def _req(seed: int, n: int, m: int) -> Request:
    return Request(_prompt(seed, n), SamplingParams(temperature=1.0, seed=seed, max_tokens=m))


@pytest.fixture(scope="module")
def params():
    return cj.init_params(BASE, jax.random.key(0))


def test_prefill_shapes_by_hand(params):
    # groups: powers of two up to the slots, the last capped at them; buckets: 16 (MIN_BUCKET), 32,
    # then max_len (64 would run past it)
    s = Sampler(params, BASE, SamplerSettings(slots=6, max_len=48))
    assert s.prefill_shapes() == [(g, b) for g in (1, 2, 4, 6) for b in (16, 32, 48)]
    assert Sampler(params, BASE, SamplerSettings(slots=8, max_len=16)).prefill_shapes() == [
        (g, 16) for g in (1, 2, 4, 8)
    ]
    assert Sampler(params, BASE, SamplerSettings(slots=1, max_len=10)).prefill_shapes() == [(1, 10)]


def test_warm_up_compiles_every_admission_program_and_changes_nothing(params):
    warm, cold = (Sampler(params, BASE, SamplerSettings(slots=4, max_len=48)) for _ in range(2))
    first = [_req(1, 9, 5), _req(2, 5, 3)]  # one group of 2 in bucket 16: (2, 16) and the decode step
    a, b = warm.run(first), cold.run([Request(r.prompt, r.params) for r in first])
    assert [c.tokens for c in a] == [c.tokens for c in b] and warm.compilations == cold.compilations == 2
    # after requests left cached prefixes: the 9 shapes (groups 1, 2, 4 x buckets 16, 32, 48)
    # less the one already met
    admitting = warm.prefill_s
    assert warm.warm_up() == 8 and warm.warm_up() == 0 and warm.warm_up_s > 0
    assert warm.prefill_s == admitting  # warm-up time is not admission time
    # then continuations (reusing the prefixes) and new prompts of other groups and buckets,
    # arriving staggered: the same completions as the sampler that was not warmed up, which traces
    # programs for them while the warmed-up one traces none
    second = [
        [Request(a[0].prompt + a[0].tokens + _prompt(3, 20), SamplingParams(temperature=1.0, seed=5, max_tokens=4))],
        [_req(4, 30, 6), _req(5, 40, 2), _req(6, 3, 7)],
        [_req(7, 17, 3)],
    ]
    got, ref = [], []
    for sampler, out in ((warm, got), (cold, ref)):
        before, trace_s = sampler.compilations, sampler.prefill_trace_s
        for reqs in second:
            for r in reqs:
                sampler.submit(Request(r.prompt, r.params))
            out += sampler.step()
        while sampler.busy:
            out += sampler.step()
        traced = sampler.compilations - before
        if sampler is warm:
            assert traced == 0 and sampler.prefill_trace_s == trace_s
        else:
            # (1, 32): the continuation's 21 tokens past its 13 reused (and later the 17-token
            # prompt); the three new prompts of 30, 40 and 3 tokens in parts by bucket: (1, 16) for
            # the 3, (1, 32) again for the 30, (1, 48) for the 40 (joined they would pad to 4 x 48)
            assert traced == 3 and sampler.prefill_trace_s > trace_s
    assert len(got) == 5
    for g, r in zip(sorted(got, key=lambda c: c.prompt), sorted(ref, key=lambda c: c.prompt)):
        assert g.prompt == r.prompt and g.tokens == r.tokens
        np.testing.assert_allclose(g.logprobs, r.logprobs, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(g.routing, r.routing)
    assert warm.prefix_stats == cold.prefix_stats and warm.prefix_stats.hits >= 1


def test_warm_up_is_refused_where_it_cannot_run(params):
    busy = Sampler(params, BASE, SamplerSettings(slots=2, max_len=32))
    busy.submit(_req(1, 4, 2))
    with pytest.raises(RuntimeError, match="before any request"):
        busy.warm_up()
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = Sampler(
        cj.init_params(BASE, jax.random.key(0), mesh), BASE, SamplerSettings(slots=2, max_len=32, mesh=mesh)
    )
    assert sharded.prefill_shapes() == [(1, 16), (1, 32)]
    with pytest.raises(ValueError, match="one prompt at a time"):
        sharded.warm_up()


def test_an_admission_is_prefilled_in_parts_by_bucket(params):
    """Requests admitted together are prefilled in programs by the bucket of what each prefills: a
    long prompt does not pad three short ones to its length. Rows are independent, so each gets what
    it gets prefilled alone."""
    reqs = [_req(10, 40, 4), _req(11, 5, 4), _req(12, 6, 4), _req(13, 7, 4)]
    together = Sampler(params, BASE, SamplerSettings(slots=4, max_len=48))
    for r in reqs:
        together.submit(Request(r.prompt, r.params))
    got = together.step()
    # (4, 16) for the three short prompts (3 rows padded to 4), (1, 48) for the 40-token one (all in
    # one program would be (4, 48): 192 padded tokens against 112), and the decode step
    assert together.compilations == 3 and got == []
    while together.busy:
        got += together.step()
    alone, by_prompt = Sampler(params, BASE, SamplerSettings(slots=4, max_len=48)), {tuple(c.prompt): c for c in got}
    for r in reqs:
        c = by_prompt[tuple(r.prompt)]
        (ref,) = alone.run([Request(r.prompt, r.params)])
        assert c.prompt == ref.prompt and c.tokens == ref.tokens
        np.testing.assert_allclose(c.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(c.routing, ref.routing)

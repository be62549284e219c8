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


_ONE_PROCESS = """
import json, sys
import jax
from jax import monitoring
jax.config.update("jax_platforms", "cpu")
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
import composer_jax as cj
from composer_jax.config.sampler import SamplerConfig
from composer_jax.inference.engine.batch_sampler import Request, Sampler
from composer_jax.inference.engine.token_sampling import SamplingParams
cfg = cj.ModelConfig(num_layers=1, num_mtp_layers=0, max_position_embeddings=64, first_k_dense=1)
params = cj.init_params(cfg, jax.random.key(0))
s = Sampler.from_config(params, cfg, SamplerConfig(slots=1, compile_cache=sys.argv[1]), max_len=16)
out = s.run([Request([3, 1, 4, 1, 5], SamplingParams(temperature=1.0, seed=7, max_tokens=4))])
hits = sum(e == "/jax/compilation_cache/cache_hits" for e in events)
print(json.dumps({"tokens": out[0].tokens, "hits": hits, "compilations": s.compilations}))
"""


def test_replicas_given_one_compile_cache_load_what_the_first_compiled(tmp_path):
    """rl.sampler.compile_cache (serve --compile-cache): a second process with the same directory
    loads the first one's admission and decode programs from it instead of compiling them, and
    samples the same tokens."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cache = tmp_path / "compile cache"

    def one() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _ONE_PROCESS, str(cache)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = one()
    assert first["hits"] == 0 and first["compilations"] == 2  # (1, 16) admission, the decode step
    assert any(cache.iterdir())  # written there
    second = one()
    assert second["hits"] >= 2 and second["compilations"] == 2  # loaded: a new executable for this process
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 4


def _adm(n_prompt: int, reuse: int = 0) -> tuple[int, Request, int]:
    return (0, Request(list(range(n_prompt)), SamplingParams()), reuse)


def test_admission_parts_with_a_row_cap_by_hand():
    from composer_jax.inference.engine.batch_sampler import admission_parts

    # 5 prompts of bucket 16, 1 of bucket 64 (max_len 64)
    admit = [_adm(10) for _ in range(5)] + [_adm(40)]
    sizes = lambda cap: [len(p) for p in admission_parts(admit, cap, 64)]
    # no cap below the 8 slots: the 16s (8 rows x 16 = 128 padded) and the 64 (1 x 64) apart cost
    # 192 tokens, joined 8 x 64 = 512: apart
    assert sizes(8) == [5, 1]
    # cap 1: one row per program; parts never join across buckets (n x 64 > n1 x 16 + n2 x 64)
    assert sizes(1) == [1, 1, 1, 1, 1, 1]
    # cap 2: programs of 2 rows, the odd one a program of 1
    assert sizes(2) == [2, 2, 1, 1]
    # joining where it pads no more: 1 of bucket 16 + 3 of bucket 32 under cap 4: joined 4 x 32 = 128
    # <= 1 x 16 + 4 x 32 = 144 apart; under cap 2 the 3 take 2 + 1 rows: 1 x 16 + 3 x 32 = 112 < 128, apart
    mixed = [_adm(10)] + [_adm(20)] * 3
    assert [len(p) for p in admission_parts(mixed, 4, 64)] == [4]
    assert [len(p) for p in admission_parts(mixed, 2, 64)] == [1, 2, 1]


def test_admission_rows_caps_the_programs_and_keeps_the_completions(params):
    capped = Sampler(params, BASE, SamplerSettings(slots=4, max_len=48, admission_rows=1))
    free = Sampler(params, BASE, SamplerSettings(slots=4, max_len=48))
    assert capped.prefill_shapes() == [(1, b) for b in (16, 32, 48)]
    assert Sampler(params, BASE, SamplerSettings(slots=4, max_len=48, admission_rows=2)).prefill_shapes() == [
        (g, b) for g in (1, 2) for b in (16, 32, 48)
    ]
    reqs = [_req(1, 9, 5), _req(2, 5, 3), _req(3, 12, 4), _req(4, 30, 2)]
    a, b = capped.run(reqs), free.run([Request(r.prompt, r.params) for r in reqs])
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    # capped: (1, 16) and (1, 32) and the decode step; free: (4, 16) for the three of bucket 16 and
    # (1, 32) for the 30 (joined 4 x 32 = 128 > 4 x 16 + 1 x 32 = 96), and the decode step
    assert capped.compilations == 3 and free.compilations == 3
    with pytest.raises(cj.ConfigError, match="admission_rows=0 must be >= 1"):
        SamplerSettings(slots=4, max_len=48, admission_rows=0)

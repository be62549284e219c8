"""MTP speculative decoding: greedy tokens, log-probabilities and routing equal the sampler's
without speculation (MLA and GQA, staggered requests, a weight swap, the 8-device mesh); sampled
tokens follow the exact distribution (the accept/resample rule against numpy, and the whole
sampler against the model's distribution computed by full forwards); the cached MTP module equals
the training forward; acceptance statistics on a model whose drafts are right by construction."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from support.small_models import gqa

import composer_jax as cj
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.draft_verify import SpecStats, draft_model, verify_drafts
from composer_jax.inference.engine.token_sampling import SamplingParams, draw, processed_logprobs, token_uniforms
from composer_jax.model.kv_cache import init_cache
from composer_jax.model.transformer import logits_of, mtp_forward_cached
from composer_jax.specs import path_str

MLA = cj.ModelConfig(num_layers=2, num_mtp_layers=1, max_position_embeddings=64)
GQA = gqa(MLA)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
K = 2


def _prompt(seed: int, n: int, vocab: int = MLA.vocab_size) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _staggered() -> list[Request]:
    # 5 requests of different prompt and output lengths through 2 slots: they join as others leave
    return [
        Request(_prompt(i, n), dataclasses.replace(GREEDY, max_tokens=m))
        for i, (n, m) in enumerate([(5, 9), (11, 3), (3, 12), (17, 4), (8, 7)])
    ]


def _chi2_threshold(df: int) -> float:
    return float(stats.chi2.ppf(1 - 1e-4, df))


def _chi2(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of counts against probabilities; cells of probability 0 must be empty.
    Cells expected fewer than 5 times are pooled into one (the usual rule: one event in a cell of
    expected count 0.002 would otherwise add ~500 to the statistic, so the chi-square threshold's
    false-alarm rate would not hold)."""
    n = observed.sum()
    zero = expected_p <= 0
    assert observed[zero].sum() == 0, "a token of probability 0 was emitted"
    o, e = observed[~zero], n * expected_p[~zero]
    rare = e < 5
    if rare.sum() > 1:
        o = np.append(o[~rare], o[rare].sum())
        e = np.append(e[~rare], e[rare].sum())
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


# ------------------------------------------------------------------------------------------ greedy


# gqa in the full suite only: speculation does not read the attention kind; the GQA cache is
# tests/inference/engine/test_prefix_cache.py's [gqa] case (default)
@pytest.mark.parametrize("cfg", [MLA, pytest.param(GQA, marks=pytest.mark.slow)], ids=["mla", "gqa"])
def test_greedy_equals_the_sampler_without_speculation(cfg):
    params = cj.init_params(cfg, jax.random.key(0))
    ref = Sampler(params, cfg, SamplerSettings(slots=2, max_len=40)).run(_staggered())
    spec = Sampler(params, cfg, SamplerSettings(slots=2, max_len=40, speculative_tokens=K))
    got = spec.run(_staggered())
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert a.routing is not None and b.routing is not None
        np.testing.assert_array_equal(a.routing, b.routing)  # accepted tokens' routing from the verify pass
        assert a.versions == b.versions
    # one verify program and one prefill per bucket met (16 and 32 tokens), as without speculation
    assert spec.compilations == 3
    assert spec.spec_stats.steps > 0 and len(spec.spec_stats.acceptance_rate) == K


@pytest.mark.slow  # ~12 s each under load (three compilations); the draft block itself is checked fast below
@pytest.mark.parametrize("draft_experts", [0, 1], ids=["shared", "one"])
def test_greedy_with_cheaper_drafts_equals_the_sampler_without_speculation(draft_experts):
    cfg = dataclasses.replace(MLA, num_layers=1, first_k_dense=0)
    params = cj.init_params(cfg, jax.random.key(1))
    reqs = lambda: [
        Request(_prompt(i, n), dataclasses.replace(GREEDY, max_tokens=m)) for i, (n, m) in enumerate([(5, 9), (9, 6)])
    ]
    ref = Sampler(params, cfg, SamplerSettings(slots=2, max_len=24)).run(reqs())
    spec = Sampler(params, cfg, SamplerSettings(slots=2, max_len=24, speculative_tokens=K, draft_experts=draft_experts))
    for a, b in zip(spec.run(reqs()), ref):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(a.routing, b.routing)


def _perfect_drafter(cfg: cj.ModelConfig, key) -> dict:
    """A model whose next token depends only on the current one, and an MTP module that computes
    the same function of the token it is given: attention outputs and every MLP/expert down
    projection are zero, so the main model's head sees RMSNorm(Emb(t)); eh_proj passes the token
    embedding and drops the hidden state, so the MTP module's head sees RMSNorm(RMSNorm(Emb(t')))
    = RMSNorm(Emb(t')) up to eps. Each draft is then the main model's prediction, at every depth."""
    params = cj.init_params(cfg, key)
    d = cfg.hidden_size

    def zero_outputs(tree):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros_like(x) if path_str(path).split("/")[-1] in ("o", "down", "shared_down") else x,
            tree,
        )

    params = {k: zero_outputs(v) if k in ("dense_layers", "moe_layers", "mtp") else v for k, v in params.items()}
    eh = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    params["mtp"]["eh_proj"] = jnp.broadcast_to(eh, params["mtp"]["eh_proj"].shape)
    return params


# slow: 53 s; the distribution and greedy tests below keep speculation in the default suite
@pytest.mark.slow
def test_acceptance_statistics_of_a_drafter_that_is_always_right():
    params = _perfect_drafter(MLA, jax.random.key(3))
    k = 3
    spec = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40, speculative_tokens=k))
    greedy_ref = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40)).run(_staggered())
    got = spec.run(_staggered())
    assert [c.tokens for c in got] == [c.tokens for c in greedy_ref]
    st = spec.spec_stats
    assert st.acceptance_rate == [1.0] * k  # every depth accepted, chained drafts included
    # 12 + 9 + 7 + 4 + 3 tokens, the first of each from its prefill: 30 verified, 4 per full step;
    # a request needing n more tokens takes ceil(n / 4) steps: 11 -> 3, 8 -> 2, 6 -> 2, 3 -> 1, 2 -> 1
    assert st.steps == 9 and st.tokens == 4 * 9 and st.tokens_per_step == 4.0
    # sampled: p and q agree to rounding, so every draft is accepted and, drafts being drawn with
    # the non-speculative uniform of their position, the tokens are the non-speculative sampler's
    sampled = [
        Request(r.prompt, dataclasses.replace(r.params, temperature=0.8, seed=i)) for i, r in enumerate(_staggered())
    ]
    spec2 = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40, speculative_tokens=k))
    got = spec2.run(sampled)
    ref = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40)).run(sampled)
    assert [c.tokens for c in got] == [c.tokens for c in ref]
    np.testing.assert_allclose(
        np.concatenate([c.logprobs for c in got]), np.concatenate([c.logprobs for c in ref]), atol=1e-5
    )
    assert spec2.spec_stats.acceptance_rate == [1.0] * k
    # a draft vocabulary holding every token greedy decoding can reach from these requests (the
    # closure of their tokens under t -> the model's next token, a function of t alone here): the
    # restricted head's arg-max is still the model's, so every draft is accepted
    nxt = np.asarray(jnp.argmax(cj.forward(params, jnp.arange(MLA.vocab_size)[:, None], MLA).logits[:, 0], -1))
    used = {t for c in greedy_ref for t in c.tokens}
    while not {int(nxt[t]) for t in used} <= used:
        used |= {int(nxt[t]) for t in used}
    assert len(used) < MLA.vocab_size // 4  # a real restriction
    spec3 = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40, speculative_tokens=k, draft_vocab=sorted(used)))
    got = spec3.run(_staggered())
    assert [c.tokens for c in got] == [c.tokens for c in greedy_ref]
    assert spec3.spec_stats.acceptance_rate == [1.0] * k


def test_spec_stats_counting_by_hand():
    st = SpecStats.zeros(3)
    st.add(np.array([0, 3, 1]))  # depth 1: 2 of 3 accepted, depth 2: 1 of 3, depth 3: 1 of 3
    st.add(np.array([2]))
    np.testing.assert_allclose(st.acceptance_rate, [3 / 4, 2 / 4, 1 / 4])
    assert st.steps == 4 and st.tokens == (0 + 3 + 1 + 2) + 4 and st.tokens_per_step == 10 / 4


def test_weight_swap_and_early_stop_with_speculation():
    params = cj.init_params(MLA, jax.random.key(0))
    other = jax.tree.map(lambda x: x * 1.5, params)
    p = dataclasses.replace(GREEDY, max_tokens=10)
    spec = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40, speculative_tokens=K))
    spec.submit(Request(_prompt(1, 5), p, id="a"))
    spec.step()
    spec.step()
    running = spec._slot[0]
    assert running is not None
    before = len(running.tokens)
    spec.update_weights(other, version=1)
    (a,) = _finish(spec)
    assert len(a.tokens) == 10 and a.versions == [0] * before + [1] * (10 - before)
    # the same swap point without speculation: the same tokens (the cache of earlier tokens stays)
    ref = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40))
    ref.submit(Request(_prompt(1, 5), p, id="a"))
    while (s := ref._slot[0]) is None or len(s.tokens) < before:
        ref.step()
    ref.update_weights(other, version=1)
    (b,) = _finish(ref)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # a stop token inside a step's accepted run ends the request there, as without speculation
    (base,) = Sampler(params, MLA, SamplerSettings(slots=1, max_len=40)).run([Request(_prompt(1, 5), p)])
    stop = base.tokens[4]
    with_stop = Request(_prompt(1, 5), dataclasses.replace(p, stop_token_ids=(stop,)))
    (c,) = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40, speculative_tokens=K)).run([with_stop])
    assert c.tokens == base.tokens[: base.tokens.index(stop) + 1] and c.finish_reason == "stop"


def _finish(sampler: Sampler) -> list:
    done = []
    while sampler.busy:
        done += sampler.step()
    return done


@pytest.mark.slow  # 1-3 min on 2 cores; the sharded sampler without speculation is tested in the default suite
def test_sharded_speculative_sampler_gives_the_single_device_tokens():
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, tensor=2))
    params = cj.init_params(MLA, jax.random.key(0))
    sharded = cj.init_params(MLA, jax.random.key(0), mesh)
    reqs = [
        Request(_prompt(i, n), SamplingParams(temperature=t, max_tokens=6, seed=i))
        for i, (n, t) in enumerate([(3, 0.0), (6, 1.0), (9, 0.0), (4, 0.7), (5, 1.0)])
    ]
    ref = Sampler(params, MLA, SamplerSettings(slots=4, max_len=24, speculative_tokens=K)).run(reqs)
    got = Sampler(sharded, MLA, SamplerSettings(slots=4, max_len=24, mesh=mesh, speculative_tokens=K)).run(
        [Request(r.prompt, r.params) for r in reqs]
    )
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.slow  # 1-3 min on 2 cores; the sharded sampler without speculation is tested in the default suite
def test_expert_parallel_speculation_never_drops_so_greedy_tokens_are_the_single_device_ones():
    """On an expert-parallel mesh whose capacity factor makes the training forward drop
    assignments, inference steps take the dropless exchange (`moe.decode.decode_expert_parallel`): the
    speculative sampler's greedy tokens, log-probabilities and routing equal the single-device
    sampler's without speculation."""
    cfg = dataclasses.replace(MLA, moe_ep_exchange="ragged_emulated", moe_ep_capacity_factor=0.5)
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=2, expert=4, tensor=1))
    sharded = cj.init_params(cfg, jax.random.key(0), mesh)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 12)), jnp.int32)
    with jax.set_mesh(mesh):
        dropped = jax.jit(lambda p, t: cj.forward(p, t, cfg).aux["moe_dropped"])(sharded, tokens)
    assert float(np.sum(dropped)) > 0, "the capacity factor should make the training forward drop"
    params = cj.init_params(MLA, jax.random.key(0))
    reqs = lambda: [Request(_prompt(i, n), GREEDY) for i, n in enumerate([3, 6, 9, 4, 5, 7, 2, 8, 5])]
    ref = Sampler(params, MLA, SamplerSettings(slots=8, max_len=24)).run(reqs())
    got = Sampler(sharded, cfg, SamplerSettings(slots=8, max_len=24, mesh=mesh, speculative_tokens=K)).run(reqs())
    for a, b in zip(got, ref):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_array_equal(a.routing, b.routing)


def test_refused_without_mtp_modules():
    cfg = dataclasses.replace(MLA, num_mtp_layers=0)
    with pytest.raises(ValueError, match="model.num_mtp_layers=0"):
        Sampler(cj.init_params(cfg, jax.random.key(0)), cfg, SamplerSettings(slots=1, max_len=16, speculative_tokens=2))


def test_draft_experts_bad_values_are_refused():
    params = cj.init_params(MLA, jax.random.key(0))  # 2 experts per token, 1 shared expert
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=rf"draft experts={bad} must be in 0\.\.model\.num_experts_per_tok=2"):
            Sampler(params, MLA, SamplerSettings(slots=1, max_len=16, speculative_tokens=2, draft_experts=bad))
    with pytest.raises(ValueError, match="draft_experts=1 needs speculative_tokens >= 1"):
        Sampler(params, MLA, SamplerSettings(slots=1, max_len=16, draft_experts=1))
    no_shared = dataclasses.replace(MLA, num_shared_experts=0)
    with pytest.raises(ValueError, match="0, shared expert only, needs model.num_shared_experts >= 1"):
        Sampler(
            cj.init_params(no_shared, jax.random.key(0)),
            no_shared,
            SamplerSettings(slots=1, max_len=16, speculative_tokens=1, draft_experts=0),
        )


def test_draft_model_against_hand_built_references():
    """The cheaper MTP block of the drafts against independent constructions: shared expert only
    equals the full block with every routed expert's output projection zeroed; one expert per
    token equals the training forward with the router's top choice replayed."""
    cfg = dataclasses.replace(MLA, num_layers=1, first_k_dense=0, num_experts_per_tok=3, n_group=1, topk_group=1)
    params = cj.init_params(cfg, jax.random.key(3))
    h = jax.random.normal(jax.random.key(4), (2, 5, cfg.hidden_size), jnp.float32)
    nxt = jax.random.randint(jax.random.key(5), (2, 5), 0, cfg.vocab_size, jnp.int32)
    run = jax.jit(
        lambda p, c: mtp_forward_cached(p, h, nxt, c, init_cache(c, 2, 8, mtp_modules=1))[0], static_argnums=1
    )

    moe = params["mtp"]["layer"]["moe"]
    zeroed = {**moe, "down": jnp.zeros_like(moe["down"])}
    ref0 = run({**params, "mtp": {**params["mtp"], "layer": {**params["mtp"]["layer"], "moe": zeroed}}}, cfg)
    got0 = np.asarray(run(*draft_model(params, cfg, 0)))
    np.testing.assert_allclose(got0, np.asarray(ref0), atol=1e-5, rtol=1e-5)
    assert not np.allclose(got0, np.asarray(run(params, cfg)), atol=1e-3)  # the routed experts did count
    assert draft_model(params, cfg, 3) == (params, cfg)  # the model's own k: unchanged

    # one expert per token: the training forward with module 1's routing replayed as the router's
    # top choice three times (a replayed duplicate adds up: gates 1/3 each, renormalised) computes
    # shared(x) + routed_scaling_factor * expert_top1(x), what the one-expert draft block must
    seq = jax.random.randint(jax.random.key(6), (2, 9), 0, cfg.vocab_size, jnp.int32)
    fwd = jax.jit(lambda p, r: cj.forward(p, seq, cfg, mtp_routing=r))
    full = fwd(params, None)
    assert full.mtp_routing is not None
    ref1 = fwd(params, jnp.repeat(full.mtp_routing[..., :1], 3, axis=-1)).mtp_logits[0]
    after = jnp.concatenate([seq[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)
    p1, c1 = draft_model(params, cfg, 1)
    h1, _ = jax.jit(lambda p, h: mtp_forward_cached(p, h, after, c1, init_cache(c1, 2, 12, mtp_modules=1)))(
        p1, full.hidden
    )
    got1 = np.asarray(logits_of(params, h1, cfg))[:, :8]
    np.testing.assert_allclose(got1, np.asarray(ref1)[:, :8], atol=1e-4, rtol=1e-4)
    assert not np.allclose(got1, np.asarray(full.mtp_logits[0])[:, :8], atol=1e-3)  # not the full block


# ---------------------------------------------------------------------------- MTP cache numerics


def test_cached_mtp_module_equals_the_training_forward():
    cfg = dataclasses.replace(MLA, q_lora_rank=16)
    params = cj.init_params(cfg, jax.random.key(4))
    seq = jax.random.randint(jax.random.key(5), (2, 13), 0, cfg.vocab_size, jnp.int32)
    # jitted: op-by-op dispatch of these forwards took over a minute
    full = jax.jit(cj.forward, static_argnums=2)(params, seq, cfg)  # mtp_logits[0, :, j]: module 1 at j, given t_{j+1}
    cache = init_cache(cfg, 2, 16, mtp_modules=1)
    after = jnp.concatenate([seq[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)
    mtp_step = jax.jit(lambda p, h, t, c: mtp_forward_cached(p, h, t, cfg, c))
    logits = []
    for a, b in [(0, 5), (5, 6), (6, 12)]:  # chunks, as prefill then verify windows append them
        h, cache = mtp_step(params, full.hidden[:, a:b], after[:, a:b], cache)
        logits.append(logits_of(params, h, cfg))
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(logits, axis=1)), np.asarray(full.mtp_logits[0, :, :12]), atol=1e-4, rtol=1e-4
    )
    assert np.asarray(cache.lengths).tolist() == [12, 12]


# ---------------------------------------------------------------------------- distributions


def _rule_outcomes(p, q, temperature: float, n: int):
    """n independent verify steps of one slot each (seeds 0..n-1) with context-free distributions:
    p float[k+1, V], q float[k, V]. Drafts are drawn from q as the sampler draws them."""
    k = q.shape[0]
    seeds = jnp.arange(n, dtype=jnp.uint32)
    lengths = jnp.full((n,), 7, jnp.int32)
    t = jnp.full((n,), temperature, jnp.float32)
    q_lp = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (n, *q.shape))
    p_lp = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, *p.shape))
    drafts = jnp.stack([draw(q_lp[:, i], t, token_uniforms(seeds, lengths + i + 1)) for i in range(k)], 1)
    accepted, tokens, logprobs = jax.jit(verify_drafts)(p_lp, q_lp, drafts, t, seeds, lengths)
    return np.asarray(drafts), np.asarray(accepted), np.asarray(tokens), np.asarray(logprobs)


def test_accept_resample_rule_gives_the_target_distribution():
    # p and q far apart, each with a token the other cannot produce (as top-k / top-p leave them)
    p = np.array(
        [
            [0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
            [0.25, 0.00, 0.25, 0.25, 0.125, 0.125],
        ]
    )
    q = np.array([[0.05, 0.10, 0.15, 0.20, 0.30, 0.20], [0.30, 0.30, 0.00, 0.20, 0.10, 0.10]])
    n = 40_000
    drafts, accepted, tokens, logprobs = _rule_outcomes(p, q, 1.0, n)
    v = p.shape[1]
    threshold = _chi2_threshold(v - 1)
    # step i's token is p_i-distributed given the steps before it were accepted drafts
    for i in range(3):
        reached = accepted >= i
        stat, _ = _chi2(np.bincount(tokens[reached, i], minlength=v), p[i])
        assert stat < threshold, (i, stat, threshold)
    np.testing.assert_allclose(logprobs[:, 0], np.log(p[0, tokens[:, 0]]), rtol=1e-6)
    # acceptance at depth 1 is sum_x min(p, q) (Leviathan et al. sec. 3.1)
    assert abs((accepted >= 1).mean() - np.minimum(p[0], q[0]).sum()) < 4 * np.sqrt(0.25 / n)
    # power: the drafts themselves (what "always accept" would emit) fail the same test by far
    stat, _ = _chi2(np.bincount(drafts[:, 0], minlength=v), np.where(p[0] > 0, p[0], 1e-12))
    assert stat > 100 * threshold


def test_accept_rule_greedy_by_hand():
    # p's arg-max: 2 after the last token, 1 after draft 1, 3 after draft 2
    p = np.full((1, 3, 4), 0.1)
    p[0, 0, 2] = p[0, 1, 1] = p[0, 2, 3] = 0.7
    q = np.full((1, 2, 4), 0.25)
    p_lp, q_lp, t = jnp.log(jnp.asarray(p)), jnp.log(jnp.asarray(q)), jnp.zeros((1,))
    seeds, lengths = jnp.zeros((1,), jnp.uint32), jnp.zeros((1,), jnp.int32)
    for drafts, acc, toks in [([2, 1], 2, [2, 1, 3]), ([2, 0], 1, [2, 1, 0]), ([0, 1], 0, [2, 0, 0])]:
        a, tokens, _ = verify_drafts(p_lp, q_lp, jnp.asarray([drafts], jnp.int32), t, seeds, lengths)
        assert int(a[0]) == acc and np.asarray(tokens[0]).tolist() == toks


@pytest.mark.parametrize(
    "draft_experts",
    # full suite only (~35 s each under load): the default suite keeps the accept/resample rule's
    # distribution in test_accept_resample_rule_gives_the_target_distribution and the sampler's wiring
    # of it in test_greedy_equals_the_sampler_without_speculation[mla]; the cheaper drafts (shared
    # expert only, one routed expert) change q, not p
    [pytest.param(d, marks=pytest.mark.slow) for d in (None, 0, 1)],
    ids=["full-draft", "shared-only-draft", "one-expert-draft"],
)
def test_sampled_tokens_follow_the_model_distribution(draft_experts):
    # a vocabulary of 8, peaked enough that the MTP module's guesses are far from the model's
    cfg = dataclasses.replace(MLA, vocab_size=8, initializer_range=0.5)
    params = cj.init_params(cfg, jax.random.key(7))
    prompt = _prompt(2, 4, cfg.vocab_size)
    sp = SamplingParams(temperature=0.9, top_k=6, max_tokens=3)
    n = 1500
    sampler = Sampler(
        params, cfg, SamplerSettings(slots=16, max_len=16, speculative_tokens=K, draft_experts=draft_experts)
    )
    done = sampler.run([Request(prompt, dataclasses.replace(sp, seed=s)) for s in range(n)])
    toks = np.asarray([c.tokens for c in done])

    # exact: the processed distribution after the prompt, and after prompt + x for every x
    v = cfg.vocab_size
    proc = lambda logits: np.exp(
        np.asarray(
            processed_logprobs(
                logits,
                jnp.full(logits.shape[:1], sp.temperature),
                jnp.full(logits.shape[:1], sp.top_k),
                jnp.ones(logits.shape[:1]),
            )
        )
    ).astype(np.float64)
    seqs = jnp.asarray([prompt + [x] for x in range(v)], jnp.int32)
    out = cj.forward(params, seqs, cfg)
    p0 = proc(out.logits[:1, len(prompt) - 1])[0]
    p1 = proc(out.logits[:, -1])  # [x, y]: p(y | prompt, x)
    joint = p0[:, None] * p1  # tokens 1 and 2 of every request: the second is speculative
    stat, df = _chi2(np.bincount(toks[:, 0] * v + toks[:, 1], minlength=v * v).astype(float), joint.reshape(-1))
    assert stat < _chi2_threshold(df), (stat, df)
    # the third token (a draft verified after an accepted one, or a resample, or a bonus)
    seqs2 = jnp.asarray([prompt + [x, y] for x in range(v) for y in range(v)], jnp.int32)
    p2 = proc(cj.forward(params, seqs2, cfg).logits[:, -1]).reshape(v, v, v)
    marg2 = np.einsum("xy,xyz->z", joint, p2)
    stat, df = _chi2(np.bincount(toks[:, 2], minlength=v).astype(float), marg2)
    assert stat < _chi2_threshold(df), (stat, df)
    # power: emitting the drafts unverified ("always accept") gives token 2 the MTP module's
    # distribution sum_x p0(x) q(. | x), whose expected statistic against the truth at this n is
    # n * chi2-divergence; it must clear the threshold many times over
    # module 1 (as the drafts run it) at the prompt's end, given x
    dp, dcfg = (params, cfg) if draft_experts is None else draft_model(params, cfg, draft_experts)
    q1 = proc(cj.forward(dp, seqs, dcfg).mtp_logits[0, :, len(prompt) - 1])
    wrong = p0 @ q1
    marg1 = p0 @ p1
    kept = marg1 > 0
    divergence = n * (((wrong - marg1)[kept]) ** 2 / marg1[kept]).sum() + (n if (wrong[~kept] > 0.01).any() else 0)
    assert divergence > 10 * _chi2_threshold(v - 1), divergence
    assert 0 < sampler.spec_stats.acceptance_rate[0] < 1


# ---------------------------------------------------------------------------- verify chunks


def test_chunked_verify_steps_on_a_dense_model():
    """The fast check of verify chunks (the full one below is slow): a one-layer dense model, k = 1,
    greedy and sampled requests, one with a stop id, staggered through 2 slots: the chunked
    sampler's tokens, log-probabilities and acceptance counts are the one-step sampler's."""
    cfg = dataclasses.replace(MLA, num_layers=1, first_k_dense=1)
    params = cj.init_params(cfg, jax.random.key(1))
    reqs = lambda stops: [
        Request(_prompt(60 + i, n), SamplingParams(temperature=t, max_tokens=m, seed=i, stop_token_ids=stops[i]))
        for i, (n, m, t) in enumerate([(5, 9, 0.0), (9, 4, 1.0), (3, 12, 1.0), (7, 8, 0.0)])
    ]
    one = Sampler(params, cfg, SamplerSettings(slots=2, max_len=32, speculative_tokens=1))
    chunked = Sampler(params, cfg, SamplerSettings(slots=2, max_len=32, speculative_tokens=1, decode_chunk=3))
    free = one.run(reqs([()] * 4))
    one.spec_stats = SpecStats.zeros(1)
    stops = [(), (), (free[2].tokens[5],), ()]
    a_run, b_run = one.run(reqs(stops)), chunked.run(reqs(stops))
    assert a_run[2].finish_reason == "stop" and len(a_run[2].tokens) <= 6
    for a, b in zip(a_run, b_run):
        assert (a.tokens, a.finish_reason, a.versions) == (b.tokens, b.finish_reason, b.versions)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(one.spec_stats.accepted, chunked.spec_stats.accepted)
    assert (one.spec_stats.steps, one.spec_stats.tokens) == (chunked.spec_stats.steps, chunked.spec_stats.tokens)


@pytest.mark.slow  # ~25 s on a quiet machine, 70 s under load (cold compilation cache)
def test_chunked_verify_steps_equal_one_step_per_call():
    """Several verify steps per compiled call (decode_chunk) give the one-step speculative sampler's
    tokens, log-probabilities, routing, versions, finish reasons and acceptance counts: greedy and
    sampled (same seeds) requests, staggered through 2 slots; stops on device (a stop id among the
    first STOP_IDS_ON_DEVICE), on the host only (the 9th stop id; a stop string), and by max_tokens.
    Then a weight swap between two chunks."""
    params = cj.init_params(MLA, jax.random.key(0))
    text = lambda ids: "".join(chr(97 + t % 26) for t in ids)

    def reqs(stop_ids, stop_strings):
        return [
            Request(
                _prompt(40 + i, n),
                SamplingParams(
                    temperature=(0.0, 1.0)[i % 2],
                    max_tokens=m,
                    seed=i,
                    stop_token_ids=stop_ids[i],
                    stop_strings=stop_strings[i],
                ),
            )
            for i, (n, m) in enumerate([(5, 11), (11, 3), (3, 12), (13, 9), (8, 7), (6, 10)])
        ]

    make = lambda chunk: Sampler(
        params, MLA, SamplerSettings(slots=2, max_len=40, speculative_tokens=K, decode_chunk=chunk, detokenize=text)
    )
    one, chunked = make(1), make(4)
    free = one.run(reqs([()] * 6, [()] * 6))
    one.spec_stats = SpecStats.zeros(K)
    far = tuple(t for t in range(100, 140) if t not in free[2].tokens)[:8]
    stop_ids = [(free[0].tokens[3],), (), far + (free[2].tokens[6],), (), (), ()]
    stop_strings = [(), (), (), (text(free[3].tokens[4:6]),), (), ()]
    a_run, b_run = one.run(reqs(stop_ids, stop_strings)), chunked.run(reqs(stop_ids, stop_strings))
    assert a_run[0].finish_reason == a_run[2].finish_reason == a_run[3].finish_reason == "stop"
    assert len(a_run[0].tokens) <= 4 and len(a_run[2].tokens) <= 7 and len(a_run[3].tokens) <= 6
    assert [c.finish_reason for c in a_run[4:]] == ["length"] * 2
    for a, b in zip(a_run, b_run):
        assert (a.tokens, a.finish_reason, a.versions) == (b.tokens, b.finish_reason, b.versions)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(a.routing, b.routing)
    for field in ("proposed", "accepted"):
        np.testing.assert_array_equal(getattr(one.spec_stats, field), getattr(chunked.spec_stats, field))
    assert (one.spec_stats.steps, one.spec_stats.tokens) == (chunked.spec_stats.steps, chunked.spec_stats.tokens)
    assert chunked.compilations == one.compilations == 2  # one prefill (bucket 16) + the chunk / the verify step

    # a weight swap between two chunks: later tokens carry the new version, and (greedy) equal the
    # one-step speculative sampler's with the swap at the same token (the first step at or after it:
    # greedy tokens do not depend on where the verify steps fall)
    other = jax.tree.map(lambda x: x * 1.5, params)
    p = dataclasses.replace(GREEDY, max_tokens=24)
    chunked.submit(Request(_prompt(1, 5), p, id="a"))
    chunked.step()
    running = chunked._slot[0]
    assert running is not None
    before = len(running.tokens)
    assert 5 <= before <= 1 + 4 * (K + 1)  # the prefill's token and four verify steps of 1..K+1 tokens
    chunked.update_weights(other, version=1)
    (a,) = _finish(chunked)
    assert a.versions == [0] * before + [1] * (24 - before)
    ref = Sampler(params, MLA, SamplerSettings(slots=2, max_len=40))
    ref.submit(Request(_prompt(1, 5), p, id="a"))
    while (s := ref._slot[0]) is None or len(s.tokens) < before:
        ref.step()
    ref.update_weights(other, version=1)
    (b,) = _finish(ref)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)

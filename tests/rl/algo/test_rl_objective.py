"""The RL objective on the tiny MoE model, through the train step: equal to an independent
whole-batch reference (full logits, no chunking, written without the objective's helpers);
micro-batched equal to the full batch; sharded (expert, fsdp, zigzag context parallelism) equal to
unsharded; router replay changing the loss only when the replayed routing differs from the one the
model picks for tokens that are trained on; the reference log-probabilities and the k1 metric."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.rl.algo.batch import GenerationRecord, ScoredRollout, build_batch
from composer_jax.rl.algo.loss import ROUTING_AXES, prepare_rl_batch, reference_logprobs, rl_objective
from composer_jax.sharding import MeshRules, ShardingRules
from composer_jax.train.state import init_train_state
from composer_jax.train.step import batch_gradients, make_train_step

TINY = Path(__file__).resolve().parents[3] / "configs" / "model" / "tiny.yaml"
B, S = 8, 16
RL = [
    "model.num_mtp_layers=0",
    "model.num_layers=2",  # one dense layer, one MoE layer
    f"train.batch_size={B}",
    f"train.seq_len={S}",
    "rl.loss.clip_eps_low=0.2",
    "rl.loss.clip_eps_high=0.3",
    "rl.loss.kl_coef=0.05",
    "rl.loss.plausibility_band=[0.5, 2.0]",
    "rl.loss.normalizer=100",
    "rl.loss.temperature=0.9",
]
BAND, CLIP, BETA, NORM, TEMP = (0.5, 2.0), (0.8, 1.3), 0.05, 100.0, 0.9


def _cfg(*extra: str) -> cj.Config:
    """The test's config; an override in `extra` replaces RL's of the same key."""
    given = {e.split("=", 1)[0] for e in extra}
    return cj.load_config(TINY, [o for o in RL if o.split("=", 1)[0] not in given] + list(extra), num_devices=8)


def _model_logprobs(params, tokens, segment_ids, cfg):
    """log softmax(logits / T) of each token given the ones before it (index i: token i + 1), and
    the routing the model picks: a plain forward with full logits ([rows, seq - 1], [L, rows, seq, k])."""
    out = cj.forward(params, tokens, cfg.model, segment_ids=segment_ids)
    logp = jax.nn.log_softmax(out.logits[:, :-1] / TEMP, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], out.routing


@pytest.fixture(scope="module")
def setup():
    """8 rollouts in 4 groups of 2: prompt, policy tokens, a tool observation, policy tokens; the
    sampler's log-probs are the model's own plus noise (so ratios spread over the clip range and
    past the plausibility band) and its routing is the model's own (as the sampler records it)."""
    cfg = _cfg()
    params = cj.init_params(cfg.model, jax.random.key(0))
    rng = np.random.default_rng(7)
    lengths = rng.integers(10, S + 1, B)
    tokens = rng.integers(1, cfg.model.vocab_size, (B, S)).astype(np.int32)
    seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
    lp, routing = jax.jit(lambda p, t, s: _model_logprobs(p, t, s, cfg))(params, tokens, seg)
    lp, routing = np.asarray(lp), np.asarray(routing)
    rollouts = []
    for i, n in enumerate(lengths):
        mask = np.zeros(n, np.int32)
        mask[3:7] = 1  # tokens 7..8 are a tool observation
        mask[9:] = 1
        logprobs = np.concatenate([[0.0], lp[i, : n - 1]]) + rng.normal(0.0, 0.4, n)
        gen = GenerationRecord(tokens[i, :n], mask, logprobs, routing=routing[:, i, : n - 1].transpose(1, 0, 2))
        rollouts.append(ScoredRollout(i // 2, float(rng.integers(0, 2)), [gen]))
    batch = build_batch(rollouts, cfg)
    ref_params = cj.init_params(cfg.model, jax.random.key(1))
    ref_fn = jax.jit(lambda p, b: reference_logprobs(p, b, cfg))
    batch["ref_logprobs"] = np.asarray(ref_fn(ref_params, batch))
    obj = rl_objective(cfg)
    value, grads, sums, denoms = jax.jit(lambda p, b: batch_gradients(p, b, cfg, objective=obj))(params, batch)
    return cfg, params, ref_params, batch, (value, grads, sums, denoms), ref_fn


def _reference_loss(params, batch, cfg, importance=("band", None)):
    """The whole-batch objective written out from docs/rl.md: full logits, slices for the shift.
    importance: ("band", None) (the run's [0.5, 2]), ("tis", C) or ("icepop", C)."""
    tokens = jnp.asarray(batch["tokens"])
    seg = jnp.asarray(batch["segment_ids"])
    routing = jnp.transpose(jnp.asarray(batch["routing"]), (2, 0, 1, 3))
    logits = cj.forward(params, tokens, cfg.model, segment_ids=seg, routing=routing).logits[:, :-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits / TEMP, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]
    mask = jnp.asarray(batch["loss_mask"])[:, 1:] * (seg[:, 1:] == seg[:, :-1]) * (seg[:, 1:] > 0)
    adv = jnp.asarray(batch["advantages"])[:, 1:]
    log_r = jnp.where(mask > 0, logp - jnp.asarray(batch["sampler_logprobs"])[:, 1:], 0.0)
    r_stop = jnp.exp(jax.lax.stop_gradient(log_r))
    name, cap = importance
    lo, hi = {"band": BAND, "tis": (0.0, jnp.inf), "icepop": (1 / (cap or 1), cap)}[name]
    keep = mask * (r_stop >= lo) * (r_stop <= hi)
    ratio = jnp.exp(jnp.where(keep > 0, log_r, 0.0))
    if name == "tis":  # value min(r, C), gradient min(r, C) d log pi
        ratio = ratio * jax.lax.stop_gradient(jnp.minimum(1.0, cap / ratio))
    pg = jnp.minimum(ratio * adv, jnp.clip(ratio, *CLIP) * adv)
    k1 = jax.lax.stop_gradient(logp - jnp.asarray(batch["ref_logprobs"])[:, 1:])
    return jnp.sum(keep * (-pg + BETA * k1 * ratio)) / NORM, (mask, keep)


def test_objective_equals_the_whole_batch_reference(setup):
    cfg, params, _, batch, (value, grads, sums, denoms), _ = setup
    (ref_value, (mask, keep)), ref_grads = jax.jit(
        lambda p: jax.value_and_grad(_reference_loss, has_aux=True)(p, batch, cfg)
    )(params)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    for path, g in jax.tree_util.tree_leaves_with_path(ref_grads):
        np.testing.assert_allclose(flat[path], g, atol=1e-6, rtol=2e-4, err_msg=jax.tree_util.keystr(path))
    # build_batch + reference_logprobs give exactly the objective's keys (the step's jit wants them)
    assert set(batch) == set(rl_objective(cfg).batch_keys)
    m = rl_objective(cfg).metrics(sums, denoms, cfg)
    # the batch exercises every path: some tokens filtered, some clipped, policy tokens counted
    assert float(m["policy_tokens"]) == float(mask.sum())
    np.testing.assert_allclose(float(m["filtered_fraction"]), 1 - float(keep.sum() / mask.sum()), rtol=1e-6)
    assert 0.0 < float(m["filtered_fraction"]) < 0.5 and 0.0 < float(m["clip_fraction"]) < 1.0
    np.testing.assert_allclose(float(m["pg_loss"]) + float(m["kl_loss"]), float(value), rtol=1e-5)
    assert 0.0 < float(m["entropy"]) < np.log(cfg.model.vocab_size)


def test_micro_batches_equal_the_full_batch(setup):
    _, params, _, batch, (value, grads, sums, _), _ = setup
    cfg4 = _cfg("train.micro_batches=4")
    obj = rl_objective(cfg4)
    v4, g4, s4, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg4, objective=obj))(params, batch)
    np.testing.assert_allclose(float(v4), float(value), rtol=2e-6)
    for k in ("pg_loss", "kl_loss", "policy_tokens", "kept_tokens", "clipped_tokens", "entropy", "expert_counts"):
        np.testing.assert_allclose(np.asarray(s4[k]), np.asarray(sums[k]), rtol=2e-5, atol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-4), g4, grads)


def test_sharded_equals_unsharded_with_expert_and_context_parallelism(setup):
    cfg, params, _, batch, (value, grads, sums, _), ref_fn = setup
    # fsdp 2 x expert 2 x context 2: the recorded routing is split with the tokens, the sequence is
    # in the zigzag layout, the MoE layer's all-to-all carries the replayed experts
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=2, expert=2, context=2, tensor=1))
    rules = ShardingRules.create()
    sharded = cj.init_params(cfg.model, jax.random.key(0), mesh, rules)
    obj = rl_objective(cfg)
    with jax.set_mesh(mesh):
        v, g, s, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg, MeshRules(mesh, rules), obj))(sharded, batch)
        # the reference forward under the same mesh undoes the zigzag layout
        ref_sharded = jax.jit(lambda p, b: reference_logprobs(p, b, cfg, MeshRules(mesh, rules)))(sharded, batch)
        # and by micro-batches of the sharded rows (2 x 4 rows, one per batch shard)
        micro = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=2))
        ref_micro = jax.jit(lambda p, b: reference_logprobs(p, b, micro, MeshRules(mesh, rules)))(sharded, batch)
    np.testing.assert_allclose(np.asarray(ref_sharded), np.asarray(ref_fn(params, batch)), atol=2e-5)
    np.testing.assert_allclose(np.asarray(ref_micro), np.asarray(ref_fn(params, batch)), atol=2e-5)
    np.testing.assert_allclose(float(v), float(value), rtol=2e-6)
    for k in ("pg_loss", "kl_loss", "kept_tokens", "clipped_tokens", "entropy", "mismatch_kl_k3", "expert_counts"):
        np.testing.assert_allclose(np.asarray(s[k]), np.asarray(sums[k]), rtol=2e-5, atol=1e-6, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=2e-4), g, grads)


def test_train_step_on_the_mesh(setup):
    # make_train_step's batch shardings take the [batch, seq, moe_layers, k] routing as well
    cfg, params, _, batch, (value, _, _, _), _ = setup
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, expert=2, context=1, tensor=1))
    rules = ShardingRules.create()
    state = init_train_state(cfg, mesh, rules, params=jax.device_put(params))
    step = make_train_step(cfg, mesh, rules, objective=rl_objective(cfg), donate=False)
    with jax.set_mesh(mesh):
        new, m = step(state, batch)
    np.testing.assert_allclose(float(m["loss"]), float(value), rtol=2e-6)
    assert int(m["skipped"]) == 0 and int(new.step) == 1
    assert {"pg_loss", "kl_loss", "kl_ref", "mismatch_kl_k1", "filtered_fraction", "clip_fraction"} <= set(m)


_VALUE_FNS: dict[tuple[str, ...], tuple] = {}


def _value_fn(*extra: str):
    """jit(batch -> (objective, metric sums, denominators)) without gradients, one per config."""
    if extra not in _VALUE_FNS:
        cfg = _cfg(*extra)
        obj = rl_objective(cfg)

        def value(p, b):
            prep, denoms = obj.prepare(p, b, cfg, 1)
            v, sums = obj.terms(p, prep, cfg, denoms, None)
            return v, obj.metrics(sums, denoms, cfg)

        _VALUE_FNS[extra] = (jax.jit(value), obj.batch_keys)
    return _VALUE_FNS[extra]


@pytest.mark.parametrize("name", ["tis", "icepop"])
def test_importance_corrections_equal_the_whole_batch_reference(setup, name):
    """rl.loss.importance=tis / icepop (C = 1.5) through the objective: its value and its metric (the
    fraction truncated / masked) equal the reference's (the gradients: test_rl_loss_hand's numpy
    reference of the per-token objective)."""
    cfg, params, _, batch, _, _ = setup
    extra = ("rl.loss.plausibility_band=null", f"rl.loss.importance={name}", "rl.loss.importance_cap=1.5")
    value, metrics = _value_fn(*extra)[0](params, batch)
    want, (mask, keep) = jax.jit(lambda p: _reference_loss(p, batch, _cfg(*extra), (name, 1.5)))(params)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    assert "filtered_fraction" in metrics and "clip_fraction" in metrics
    if name == "tis":
        assert float(keep.sum()) == float(mask.sum()) and "masked_fraction" not in metrics
        # the reference's count: sampler log-probs are the model's plus N(0, 0.4) noise, so some exceed C
        tokens, seg = jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"])
        log_r = jax.jit(lambda p: _model_logprobs(p, tokens, seg, cfg)[0])(params)
        log_r = log_r - jnp.asarray(batch["sampler_logprobs"])[:, 1:]
        over = float(jnp.sum(mask * (log_r > np.log(1.5))) / mask.sum())
        np.testing.assert_allclose(float(metrics["truncated_fraction"]), over, rtol=1e-6)
        assert 0.0 < over < 0.5
    else:
        masked = 1.0 - float(keep.sum() / mask.sum())
        np.testing.assert_allclose(float(metrics["masked_fraction"]), masked, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["filtered_fraction"]), masked, rtol=1e-6)
        assert 0.0 < masked < 0.5 and "truncated_fraction" not in metrics


def test_router_replay_changes_the_loss_only_when_routing_differs(setup):
    cfg, params, _, batch, (value, _, _, _), _ = setup
    replay, keys = _value_fn()
    assert "routing" in keys
    no_replay, keys_off = _value_fn("rl.loss.router_replay=false")
    assert "routing" not in keys_off
    # the recorded routing is what the model picks: replaying it gives the very same loss
    same = float(replay(params, batch)[0])
    assert same == float(no_replay(params, {k: batch[k] for k in keys_off})[0])
    np.testing.assert_allclose(same, float(value), rtol=1e-6)
    # row 0's token 2 (a prompt token, before every trained token) sent to other experts in the
    # first MoE layer: the tokens after it see a different hidden state, the loss changes
    other = {**batch, "routing": batch["routing"].copy()}
    other["routing"][0, 2, 0] = (other["routing"][0, 2, 0] + 3) % cfg.model.num_experts
    assert float(replay(params, other)[0]) != same
    # different experts for the padding after row 0's last token change nothing (causal: no
    # trained prediction reads them), nor does the unrecorded last token's routing
    n0 = int(batch["segment_ids"][0].sum())
    pad = {**batch, "routing": batch["routing"].copy()}
    pad["routing"][0, n0 - 1 :] = (pad["routing"][0, n0 - 1 :] + 3) % cfg.model.num_experts
    assert float(replay(params, pad)[0]) == same


def test_reference_logprobs_and_k1(setup):
    cfg, params, ref_params, batch, _, ref_fn = setup
    # independent reference: a plain forward of the reference parameters with full logits
    tokens, seg = jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"])
    lp = np.asarray(jax.jit(lambda p: _model_logprobs(p, tokens, seg, cfg)[0])(ref_params))
    for row in range(B):
        n = int(batch["segment_ids"][row].sum())
        np.testing.assert_allclose(batch["ref_logprobs"][row, 1:n], lp[row, : n - 1], atol=2e-5, err_msg=f"row {row}")
        assert batch["ref_logprobs"][row, 0] == 0.0 and not batch["ref_logprobs"][row, n:].any()
    # the policy as its own reference: k1 = log pi - log pi_ref = 0 on every token
    own = {**batch, "ref_logprobs": np.asarray(ref_fn(params, batch))}
    assert abs(float(_value_fn()[0](params, own)[1]["kl_ref"])) < 1e-6


def test_reference_logprobs_run_by_micro_batches_equal_one_forward(setup):
    # train.micro_batches=4: the reference forward takes rows j, j + 4, ... at a time (the step's split)
    cfg, _, ref_params, batch, _, _ = setup
    micro = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=4))
    plain = {k: v for k, v in batch.items() if k != "ref_logprobs"}
    got = np.asarray(jax.jit(lambda p, b: reference_logprobs(p, b, micro))(ref_params, plain))
    np.testing.assert_allclose(got, batch["ref_logprobs"], atol=1e-5)
    assert not np.array_equal(got[0], got[1])  # the rows went back to their places


def test_prepared_routing_is_the_forward_layout_in_zigzag_order():
    """`prepare` hands the recorded routing on as [moe_layers, batch, seq, k] (what forward's layer
    scan slices) and permutes its sequence axis with the other arrays. Seq 8 over 2 context devices
    is 4 chunks of 2 tokens, device 0 holding chunks 0 and 3, device 1 chunks 1 and 2: positions
    hold tokens [0, 1, 6, 7, 2, 3, 4, 5]."""
    cfg = _cfg()
    b, s, layers, k = 2, 8, 3, 2
    routing = np.arange(b * s * layers * k, dtype=np.int32).reshape(b, s, layers, k)
    tokens = np.arange(b * s, dtype=np.int32).reshape(b, s)
    batch = {
        "tokens": tokens,
        "segment_ids": np.ones((b, s), np.int32),
        "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)),
        "loss_mask": np.ones((b, s), np.float32),
        "advantages": np.ones((b, s), np.float32),
        "sampler_logprobs": np.zeros((b, s), np.float32),
        "routing": routing,
    }
    plain = prepare_rl_batch(batch, cfg, 1, with_ref=False, with_routing=True)
    assert plain["routing"].shape == (layers, b, s, k)
    np.testing.assert_array_equal(plain["routing"], routing.transpose(2, 0, 1, 3))
    zigzag = prepare_rl_batch(batch, cfg, 2, with_ref=False, with_routing=True)
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    np.testing.assert_array_equal(zigzag["tokens"], tokens[:, order])
    np.testing.assert_array_equal(zigzag["routing"], routing[:, order].transpose(2, 0, 1, 3))
    assert rl_objective(_cfg()).axes_of("routing", 4) == ROUTING_AXES == (None, "act_batch", "act_seq", None)

"""The loss is an argument of the step: a custom `Objective` plugs into the same micro-batching,
accumulation, optimiser, router-bias update and NaN skip as pretraining."""

from __future__ import annotations

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.model.params import router_biases
from composer_jax.train.objective import Objective
from composer_jax.train.state import init_train_state
from composer_jax.train.step import batch_gradients, make_train_step

TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"
KEYS = ("tokens", "weights")


def _prepare(params, batch, cfg, context):
    # a per-token weighted next-token NLL; the last position of each row has no target
    tokens = batch["tokens"].astype(jnp.int32)
    weights = batch["weights"].astype(jnp.float32).at[:, -1].set(0.0)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    return {"tokens": tokens, "targets": targets, "weights": weights}, {"weight": weights.sum()}


def _terms(params, mb, cfg, denoms, sharding):
    out = cj.forward(params, mb["tokens"], cfg.model, sharding=sharding)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.take_along_axis(logp, mb["targets"][..., None], axis=-1)[..., 0]
    loss_sum = (nll * mb["weights"]).sum()
    return loss_sum / denoms["weight"], {
        "nll_sum": loss_sum,
        "expert_counts": out.aux["expert_counts"],
        "seq_balance": out.aux["seq_balance"],
    }


def _metrics(sums, denoms, cfg):
    return {"weighted_nll": sums["nll_sum"] / denoms["weight"]}


WEIGHTED_NLL = Objective("weighted_nll", KEYS, _prepare, _terms, _metrics)


def _batch(rows=8, seq=16):
    rng = np.random.default_rng(3)
    return {
        "tokens": rng.integers(0, 512, (rows, seq)).astype(np.int32),
        "weights": rng.uniform(0.0, 2.0, (rows, seq)).astype(np.float32),
    }


def _reference(params, batch, model_cfg):
    """The same objective over the whole batch at once, written independently of the step."""

    def loss(p):
        logits = cj.forward(p, jnp.asarray(batch["tokens"]), model_cfg).logits
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.asarray(batch["tokens"])[:, 1:, None], axis=-1)[..., 0]
        w = jnp.asarray(batch["weights"])[:, :-1]
        return (nll * w).sum() / w.sum()

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("micro", [1, 4])
def test_custom_objective_gradients_equal_the_whole_batch_reference(micro):
    cfg = cj.load_config(TINY, ["model.num_mtp_layers=0", f"train.micro_batches={micro}"], num_devices=None)
    params = cj.init_params(cfg.model, jax.random.key(0))
    batch = _batch()
    value, grads, sums, denoms = jax.jit(lambda p, b: batch_gradients(p, b, cfg, objective=WEIGHTED_NLL))(params, batch)
    ref_value, ref_grads = jax.jit(lambda p: _reference(p, batch, cfg.model))(params)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-6)
    np.testing.assert_allclose(float(sums["nll_sum"] / denoms["weight"]), float(ref_value), rtol=2e-6)
    chex.assert_trees_all_close(grads, ref_grads, atol=3e-6, rtol=2e-4)


def test_train_step_runs_a_custom_objective_with_router_bias_update_and_its_metrics():
    cfg = cj.load_config(
        TINY,
        [
            "model.num_mtp_layers=0",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.expert=2",
            "train.seq_len=16",
            "train.batch_size=8",
            "train.micro_batches=2",
        ],
        num_devices=8,
    )
    mesh = cj.make_mesh(cfg.mesh)
    rules = cj.ShardingRules.create()
    state = init_train_state(cfg, mesh, rules)
    bias_before = np.asarray(router_biases(state.params)["expert_counts"])
    step = make_train_step(cfg, mesh, rules, objective=WEIGHTED_NLL, donate=False)
    batch = _batch(rows=16)  # 2 micro-batches of 8 rows: one per batch shard (data x fsdp x expert)
    with jax.set_mesh(mesh):
        new, metrics = step(state, batch)
    assert set(metrics) >= {"loss", "weighted_nll", "grad_norm", "skipped", "expert_counts", "router_bias"}
    np.testing.assert_allclose(float(metrics["loss"]), float(metrics["weighted_nll"]), rtol=1e-6)
    assert int(metrics["skipped"]) == 0 and int(new.step) == 1
    # the aux-loss-free rule moved every bias by exactly +-rate or 0 (sign of mean load - load)
    counts = np.asarray(metrics["expert_counts"])
    expected = bias_before + cfg.model.router_bias_update_rate * np.sign(counts.mean(-1, keepdims=True) - counts)
    np.testing.assert_allclose(np.asarray(router_biases(new.params)["expert_counts"]), expected, rtol=0, atol=1e-7)


def test_missing_batch_key_names_the_objective_and_the_key():
    cfg = cj.load_config(TINY, ["model.num_mtp_layers=0"], num_devices=None)
    params = cj.init_params(cfg.model, jax.random.key(0))
    with pytest.raises(ValueError, match=r"weighted_nll objective needs batch keys .*missing \['weights'\]"):
        batch_gradients(params, {"tokens": _batch()["tokens"]}, cfg, objective=WEIGHTED_NLL)

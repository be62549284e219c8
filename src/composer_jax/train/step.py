"""The sharded training step: micro-batched forward/backward of an `Objective`, AdamW, the
router-bias update and the skip of non-finite updates.

The loss is an argument (`train.objective.Objective`; default `train.pretrain.PRETRAINING`): the
step knows nothing of targets or loss terms, so the RL objective reuses its micro-batching,
shardings, accumulation, optimiser, router-bias update and NaN skip unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
from einops import rearrange
from jax.sharding import Mesh, NamedSharding

from composer_jax import specs
from composer_jax.config import Config, ModelConfig
from composer_jax.model import lora
from composer_jax.model.context_parallel import context_size
from composer_jax.model.moe.expert_parallel import exchanges_per_step
from composer_jax.model.params import ROUTER_BIAS_PATHS, router_biases, update_router_biases
from composer_jax.sharding import MeshRules, ShardingRules, constrain
from composer_jax.specs import ArraySpec
from composer_jax.train import pretrain
from composer_jax.train.objective import Objective
from composer_jax.train.state import TrainState, optimizer_for, state_shardings

PRETRAINING = pretrain.PRETRAINING
BATCH_KEYS = pretrain.BATCH_KEYS


def _micro_split(x: jax.Array, micro: int, axis: int) -> jax.Array:
    """Split the batch axis `axis` into `micro` interleaved micro-batches (leading axis), so each
    device keeps its rows in every micro-batch: rows j, j+micro, j+2*micro... form micro-batch j."""
    before, after = (" ".join(f"d{i}" for i in dims) for dims in (range(axis), range(axis + 1, x.ndim)))
    return rearrange(x, f"{before} (row micro) {after} -> micro {before} row {after}", micro=micro)


def prepared(
    params: Any, batch: dict, cfg: Config, sharding: MeshRules | None, objective: Objective = PRETRAINING
) -> tuple[dict, dict]:
    """`objective.prepare`, with every array constrained to the batch/sequence sharding."""
    missing = sorted(set(objective.batch_keys) - set(batch))
    if missing:
        raise ValueError(
            f"the {objective.name} objective needs batch keys {list(objective.batch_keys)}; missing {missing}"
        )
    # every input is [batch, seq, ...]: per-token values, or per-token vectors such as the RL
    # objective's recorded routing [batch, seq, moe_layers, k]
    short = {k: batch[k].shape for k in objective.batch_keys if batch[k].ndim < 2}
    if short:
        raise ValueError(f"the {objective.name} objective's batch arrays must be [batch, seq, ...]; got shapes {short}")
    chex.assert_equal_shape_prefix([batch[k] for k in objective.batch_keys], 2)
    prep, denoms = objective.prepare(params, batch, cfg, context_size(sharding))
    for k, v in prep.items():
        prep[k] = constrain(v, sharding, objective.axes_of(k, v.ndim))
    return prep, denoms


def _finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def batch_gradients(
    params: Any,
    batch: dict,
    cfg: Config,
    sharding: MeshRules | None = None,
    objective: Objective = PRETRAINING,
    frozen: Any = None,
):
    """Whole-batch objective, gradients, metric sums and denominators, accumulated over
    `train.micro_batches`.

    Every micro-batch's terms are divided by whole-batch denominators, so the sum over micro-batches
    is exactly the full-batch objective (no mean-of-means).

    frozen: with `train.lora`, the base `params` (the adapters) apply to (`model.lora.join`); the
    gradients are the adapters' only (the base's weight gradients are never formed)."""
    scale = cfg.train.lora.scale

    def model_params(p: Any) -> Any:
        return p if frozen is None else lora.join(frozen, p, scale)

    prep, denoms = prepared(model_params(params), batch, cfg, sharding, objective)
    micro = {
        k: _micro_split(v, cfg.train.micro_batches, objective.axes_of(k, v.ndim).index("act_batch"))
        for k, v in prep.items()
    }
    grad_fn = jax.value_and_grad(lambda p, *a: objective.terms(model_params(p), *a), has_aux=True)

    def accumulate(carry, mb):
        g_acc, s_acc, obj_acc = carry
        (obj, sums), g = grad_fn(params, mb, cfg, denoms, sharding)
        return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, sums), obj_acc + obj), None

    first = jax.tree.map(lambda x: x[0], micro)
    sums_shape = jax.eval_shape(lambda: objective.terms(model_params(params), first, cfg, denoms, sharding)[1])
    zeros = (
        jax.tree.map(jnp.zeros_like, params),
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape),
        jnp.zeros((), jnp.float32),
    )
    (grads, sums, objective_value), _ = jax.lax.scan(accumulate, zeros, micro)
    return objective_value, grads, sums, denoms


def train_step(
    state: TrainState,
    batch: dict,
    cfg: Config,
    sharding: MeshRules | None,
    tx: optax.GradientTransformation,
    objective: Objective = PRETRAINING,
):
    """One optimiser step over the whole batch. Returns (new_state, metrics)."""
    m, t = cfg.model, cfg.train
    value, grads, sums, denoms = batch_gradients(state.params, batch, cfg, sharding, objective, state.frozen)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if t.router_bias_update and state.frozen is None:  # (a frozen base keeps its router biases)
        params = update_router_biases(
            params, {k: sums[k] for k in ROUTER_BIAS_PATHS if k in sums}, m.router_bias_update_rate
        )
    float_sums = [v for v in jax.tree.leaves(sums) if jnp.issubdtype(v.dtype, jnp.floating)]
    ok = jnp.isfinite(value) & jnp.isfinite(grad_norm) & _finite(float_sums or [jnp.zeros(())])
    if t.skip_nonfinite:
        params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), params, state.params)
        opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), opt_state, state.opt_state)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng, frozen=state.frozen)
    metrics = {
        "loss": value,
        **objective.metrics(sums, denoms, cfg),
        "grad_norm": grad_norm,
        "skipped": (~ok).astype(jnp.int32),
    }
    if "expert_counts" in sums:
        metrics["expert_counts"] = sums["expert_counts"]
        metrics["router_bias"] = router_biases(params if state.frozen is None else state.frozen)["expert_counts"]
        sequences = jax.tree.leaves(batch)[0].shape[0]
        metrics["seq_balance"] = sums["seq_balance"].sum() / (sequences * m.num_moe_layers)
    metrics.update(moe_exchange_metrics(sums, m))
    return new_state, metrics


def moe_exchange_metrics(sums: dict, m: ModelConfig) -> dict:
    """From the objective's sums (`pretrain.moe_exchange_sums`), over all MoE layers (MTP included)
    and micro-batches of the step: `moe_dropped`, the assignments the expert-parallel receive bound
    dropped (0 means the step was dropless); `moe_a2a_bytes_per_device`, the bytes of hidden-vector
    rows each device sent off-device in the expert all-to-alls (dispatch and combine, forward,
    backward and remat recompute: `expert_parallel.exchanges_per_step`; the int32 counts / expert
    ids beside them are left out)."""
    if "moe_dropped" not in sums:
        return {}
    dropped = sums["moe_dropped"].sum() + sums.get("mtp_moe_dropped", jnp.zeros(())).sum()
    rows = sums["moe_a2a_rows"].sum() + sums.get("mtp_moe_a2a_rows", jnp.zeros(())).sum()
    row_bytes = m.hidden_size * jnp.dtype(m.compute_dtype).itemsize
    return {"moe_dropped": dropped, "moe_a2a_bytes_per_device": rows * row_bytes * exchanges_per_step(m.remat)}


def batch_spec(shape: tuple[int, ...], dtype: str = "int32") -> ArraySpec:
    """One input array of the step, [batch, seq, *trailing]: rows over the batch axes, the sequence
    over the context axis, trailing axes (e.g. recorded routing's [moe_layers, k]) whole."""
    return ArraySpec(tuple(shape), ("act_batch", "act_seq") + (None,) * (len(shape) - 2), dtype=dtype)


def batch_specs(cfg: Config, keys: tuple[str, ...]) -> dict[str, ArraySpec]:
    """The step's batch, one [batch_size, seq_len] spec per key (a sharding of the two leading
    axes places any trailing ones whole)."""
    return {k: batch_spec((cfg.train.batch_size, cfg.train.seq_len)) for k in keys}


def batch_sharding(mesh: Mesh, rules: ShardingRules, shape: tuple[int, ...]) -> NamedSharding:
    """The sharding of a [batch, seq, ...] input array (`batch_spec`), from the one spec machinery."""
    return specs.shardings(batch_spec(shape), mesh, rules)


def make_train_step(
    cfg: Config, mesh: Mesh, rules: ShardingRules, *, objective: Objective = PRETRAINING, donate: bool = True
):
    """jit-compiled `step(state, batch) -> (state, metrics)` with explicit in/out shardings; the state
    buffers are donated. batch: dict of int/float [batch_size, seq_len, ...] arrays
    (`objective.batch_keys`), split over the batch and sequence axes (trailing axes whole)."""
    tx = optimizer_for(cfg)
    st_sh = state_shardings(cfg, mesh, rules)
    b_sh = specs.shardings(batch_specs(cfg, objective.batch_keys), mesh, rules)
    fn = functools.partial(train_step, cfg=cfg, sharding=MeshRules(mesh, rules), tx=tx, objective=objective)
    return jax.jit(
        fn,
        in_shardings=(st_sh, b_sh),
        out_shardings=(st_sh, None),
        donate_argnums=(0,) if donate else (),
    )


def make_eval_step(cfg: Config, mesh: Mesh, rules: ShardingRules):
    """jit-compiled `eval(params, batch) -> sums` of the pretraining terms (`pretrain.eval_sums`)."""
    st_sh = state_shardings(cfg, mesh, rules)
    b_sh = specs.shardings(batch_specs(cfg, BATCH_KEYS), mesh, rules)
    sharding = MeshRules(mesh, rules)

    def fn(params, batch):
        return pretrain.eval_sums(params, prepared(params, batch, cfg, sharding)[0], cfg, sharding)

    return jax.jit(fn, in_shardings=(st_sh.params, b_sh))

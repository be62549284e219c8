"""The sharded training step: micro-batched forward/backward, AdamW, router-bias update, NaN skip.

Context parallelism: when the mesh has a context axis of size C, every [batch, seq] input is
permuted along the sequence into the zigzag layout (2C chunks; device d holds chunks d and
2C-1-d) before it is split over the context axis, so every device owns an equal share of early and
late tokens and causal attention work is balanced. Targets, MTP inputs and the distillation
teacher's positions are computed before the permutation; the model is told the original order.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from composer_jax.config import Config
from composer_jax.model.moe import router_bias_update
from composer_jax.model.transformer import forward, output_head
from composer_jax.sharding import ShardingRules, constrain
from composer_jax.train import losses
from composer_jax.train.state import TrainState, optimizer_for, state_shardings

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")


def zigzag_permutation(seq: int, context: int) -> np.ndarray:
    """perm[j] = original index of the token at position j of the zigzag layout."""
    if context == 1:
        return np.arange(seq)
    chunks = np.arange(seq).reshape(2 * context, seq // (2 * context))
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * context - 1 - d]]) for d in range(context)])


def prepare_batch(batch: dict, num_mtp: int, context: int) -> dict:
    """Pipeline batch ([batch, seq] arrays) -> model inputs, targets and weights, in layout order."""
    tokens, seg = batch["tokens"].astype(jnp.int32), batch["segment_ids"].astype(jnp.int32)
    mask = batch["loss_mask"].astype(jnp.float32)
    b, s = tokens.shape
    targets, weights = losses.shifted_targets(tokens, seg, mask, 1)
    out = {"tokens": tokens, "segment_ids": seg, "positions": batch["positions"].astype(jnp.int32),
           "targets": targets, "weights": weights,
           "order": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))}
    if num_mtp:
        shift = lambda x, k: jnp.concatenate([x[:, k:], jnp.zeros((b, k), x.dtype)], axis=1)
        out["mtp_tokens"] = jnp.stack([shift(tokens, k) for k in range(1, num_mtp + 1)])
        tw = [losses.shifted_targets(tokens, seg, mask, k + 1) for k in range(1, num_mtp + 1)]
        out["mtp_targets"] = jnp.stack([t for t, _ in tw])
        out["mtp_weights"] = jnp.stack([w for _, w in tw])
        # the main model's prediction at i+k is the distillation teacher of MTP depth k at i
        out["teacher_index"] = jnp.stack([jnp.broadcast_to(jnp.minimum(jnp.arange(s) + k, s - 1), (b, s))
                                          for k in range(1, num_mtp + 1)]).astype(jnp.int32)
    if context > 1:
        perm = zigzag_permutation(s, context)
        inv = np.argsort(perm)
        for k, v in list(out.items()):
            if k == "teacher_index":
                v = jnp.asarray(inv)[v]  # original index -> position in the layout
            out[k] = jnp.take(v, jnp.asarray(perm), axis=v.ndim - 1)
    return out


def _micro_split(x: jax.Array, micro: int, axis: int) -> jax.Array:
    """Split the batch axis into `micro` interleaved micro-batches (leading axis), so each device keeps
    its rows in every micro-batch: rows j, j+micro, j+2*micro... form micro-batch j."""
    shape = x.shape
    x = x.reshape(shape[:axis] + (shape[axis] // micro, micro) + shape[axis + 1:])
    return jnp.moveaxis(x, axis + 1, 0)


def ce_chunks(shape: tuple[int, int], mesh: Mesh | None, tokens_per_chunk: int = 512) -> int:
    """Sequence chunks for the fused cross-entropy: about `tokens_per_chunk` tokens of
    [tokens, vocab] logits live at a time (512 was fastest on a 2-core CPU at vocab 32000: one chunk
    of 4096 tokens took 2.6-3.7 s for head + loss + backward, 8 chunks about 1 s, and 256 or 1024
    tokens per chunk made the whole bench step 3-6% slower). With the sequence
    split over a context axis, one chunk (chunking would cut across the sharded axis)."""
    b, s = shape
    if mesh is not None and mesh.shape.get("context", 1) > 1:
        return 1
    want = max(1, min(s, (b * s) // tokens_per_chunk))
    return max(c for c in range(1, want + 1) if s % c == 0)


def _prepared(params: Any, batch: dict, cfg: Config, rules, mesh, context: int) -> dict:
    """prepare_batch, with every array constrained to the batch/sequence sharding."""
    prep = prepare_batch(batch, cfg.model.num_mtp_layers if "mtp" in params else 0, context)
    for k, v in prep.items():
        axes = ("act_batch", "act_seq") if v.ndim == 2 else (None, "act_batch", "act_seq")
        prep[k] = constrain(v, rules, axes, mesh)
    return prep


def loss_terms(params: Any, mb: dict, cfg: Config, denoms: dict, rules, mesh):
    """Objective for one micro-batch, normalised by whole-batch denominators, and metric sums."""
    m, t = cfg.model, cfg.train
    out = forward(params, mb["tokens"], m, segment_ids=mb["segment_ids"], positions=mb["positions"],
                  token_order=mb["order"], mtp_tokens=mb.get("mtp_tokens"),
                  context_layout="zigzag" if mesh is not None and mesh.shape["context"] > 1 else "contiguous",
                  rules=rules, mesh=mesh)
    if out.mtp_logits is not None and t.mtp_loss == "self_distill":
        # the main logits are needed anyway (distillation teacher): plain cross-entropy on them
        nll, z, w, correct = losses.cross_entropy(out.logits, mb["targets"], mb["weights"], t.z_loss)
        loss_sum = nll + z
    else:
        # fused head + cross-entropy (out.logits is then unused and dead-code-eliminated by jit);
        # the same numbers, ~3x faster on CPU (see losses.fused_linear_cross_entropy)
        chunks = ce_chunks(mb["tokens"].shape, mesh)
        loss_sum, nll, z, w, correct = losses.fused_linear_cross_entropy(
            out.hidden, output_head(params, m), mb["targets"], mb["weights"], t.z_loss, chunks)
    objective = loss_sum / denoms["tokens"]
    sums = {"nll": nll, "z_loss": z, "tokens": w, "correct": correct}
    if out.mtp_logits is not None:
        mtp_obj = 0.0
        mtp_nll, mtp_correct, mtp_kl = [], [], []
        for k in range(m.num_mtp_layers):
            ce, _, wk, ck = losses.cross_entropy(out.mtp_logits[k], mb["mtp_targets"][k], mb["mtp_weights"][k])
            mtp_nll.append(ce)
            mtp_correct.append(ck)
            if t.mtp_loss == "self_distill":
                teacher = losses.gather_seq(out.logits, mb["teacher_index"][k])
                kl, _ = losses.self_distillation(out.mtp_logits[k], teacher, mb["mtp_weights"][k])
                mtp_kl.append(kl)
                term = kl
            else:
                term = ce
            mtp_obj = mtp_obj + term / jnp.maximum(denoms["mtp_tokens"][k], 1.0)
        objective = objective + t.mtp_weight * mtp_obj / m.num_mtp_layers
        sums["mtp_nll"] = jnp.stack(mtp_nll)
        sums["mtp_correct"] = jnp.stack(mtp_correct)
        if mtp_kl:
            sums["mtp_kl"] = jnp.stack(mtp_kl)
    if "expert_counts" in out.aux:
        sums["expert_counts"] = out.aux["expert_counts"]
        sums["seq_balance"] = out.aux["seq_balance"]
        if t.seq_balance_loss:
            objective = objective + t.seq_balance_loss * out.aux["seq_balance"].sum() / denoms["sequences"]
    if "mtp_expert_counts" in out.aux:
        sums["mtp_expert_counts"] = out.aux["mtp_expert_counts"]
    return objective, sums


def _finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def batch_gradients(params: Any, batch: dict, cfg: Config, rules: ShardingRules | None, mesh: Mesh | None,
                    context: int = 1):
    """Whole-batch objective, gradients and metric sums, accumulated over `train.micro_batches`.

    Every micro-batch's terms are divided by whole-batch denominators, so the sum over micro-batches
    is exactly the full-batch objective (no mean-of-means)."""
    t = cfg.train
    prep = _prepared(params, batch, cfg, rules, mesh, context)
    denoms = {"tokens": jnp.maximum(prep["weights"].sum(), 1.0),
              "sequences": jnp.asarray(prep["tokens"].shape[0], jnp.float32)}
    if "mtp_weights" in prep:
        denoms["mtp_tokens"] = prep["mtp_weights"].sum(axis=(1, 2))
    micro = jax.tree.map(lambda x: _micro_split(x, t.micro_batches, 0 if x.ndim == 2 else 1), prep)
    grad_fn = jax.value_and_grad(loss_terms, has_aux=True)

    def accumulate(carry, mb):
        g_acc, s_acc, obj_acc = carry
        (obj, sums), g = grad_fn(params, mb, cfg, denoms, rules, mesh)
        return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, sums), obj_acc + obj), None

    first = jax.tree.map(lambda x: x[0], micro)
    sums_shape = jax.eval_shape(lambda: loss_terms(params, first, cfg, denoms, rules, mesh)[1])
    zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape),
             jnp.zeros((), jnp.float32))
    (grads, sums, objective), _ = jax.lax.scan(accumulate, zeros, micro)
    return objective, grads, sums, denoms


def train_step(state: TrainState, batch: dict, cfg: Config, rules: ShardingRules, mesh: Mesh | None,
               tx: optax.GradientTransformation, context: int):
    """One optimiser step over the whole batch. Returns (new_state, metrics)."""
    m, t = cfg.model, cfg.train
    objective, grads, sums, denoms = batch_gradients(state.params, batch, cfg, rules, mesh, context)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if t.router_bias_update and "expert_counts" in sums:
        moe = params["moe_layers"]["moe"]
        moe["router_bias"] = router_bias_update(moe["router_bias"], sums["expert_counts"], m.router_bias_update_rate)
        if "mtp_expert_counts" in sums:
            mmoe = params["mtp"]["layer"]["moe"]
            mmoe["router_bias"] = router_bias_update(mmoe["router_bias"], sums["mtp_expert_counts"], m.router_bias_update_rate)
    ok = jnp.isfinite(objective) & jnp.isfinite(grad_norm) & _finite(sums.get("nll", 0.0))
    if t.skip_nonfinite:
        params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), params, state.params)
        opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), opt_state, state.opt_state)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=state.rng)
    tokens = sums["tokens"]
    metrics = {"loss": objective, "nll": sums["nll"] / jnp.maximum(tokens, 1.0),
               "z_loss": sums["z_loss"] / jnp.maximum(tokens, 1.0), "accuracy": sums["correct"] / jnp.maximum(tokens, 1.0),
               "tokens": tokens, "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}
    if "mtp_nll" in sums:
        mt = jnp.maximum(denoms["mtp_tokens"], 1.0)
        metrics["mtp_nll"] = sums["mtp_nll"] / mt
        metrics["mtp_accuracy"] = sums["mtp_correct"] / mt
        if "mtp_kl" in sums:
            metrics["mtp_kl"] = sums["mtp_kl"] / mt
    if "expert_counts" in sums:
        metrics["expert_counts"] = sums["expert_counts"]
        metrics["router_bias"] = params["moe_layers"]["moe"]["router_bias"]
        metrics["seq_balance"] = sums["seq_balance"].sum() / (denoms["sequences"] * m.num_moe_layers)
    return new_state, metrics


def batch_sharding(mesh: Mesh, rules: ShardingRules, shape: tuple[int, int]) -> NamedSharding:
    return rules.sharding(mesh, ("act_batch", "act_seq"), shape)


def make_train_step(cfg: Config, mesh: Mesh, rules: ShardingRules, *, donate: bool = True):
    """jit-compiled `step(state, batch) -> (state, metrics)` with explicit in/out shardings; the state
    buffers are donated. batch: dict of int/float [batch_size, seq_len] arrays (BATCH_KEYS)."""
    tx = optimizer_for(cfg)
    st_sh = state_shardings(cfg, mesh, rules)
    b_sh = batch_sharding(mesh, rules, (cfg.train.batch_size, cfg.train.seq_len))
    context = mesh.shape["context"]
    fn = functools.partial(train_step, cfg=cfg, rules=rules, mesh=mesh, tx=tx, context=context)
    return jax.jit(fn, in_shardings=(st_sh, {k: b_sh for k in BATCH_KEYS}), out_shardings=(st_sh, None),
                   donate_argnums=(0,) if donate else ())


def eval_sums(params: Any, batch: dict, cfg: Config, rules: ShardingRules | None, mesh: Mesh | None,
              context: int = 1) -> dict:
    """Held-out metric sums for one batch: next-token nll / tokens / correct, and MTP per depth."""
    prep = _prepared(params, batch, cfg, rules, mesh, context)
    denoms = {"tokens": jnp.ones(()), "sequences": jnp.ones(())}
    if "mtp_weights" in prep:
        denoms["mtp_tokens"] = jnp.ones((prep["mtp_weights"].shape[0],))
    _, sums = loss_terms(params, prep, cfg, denoms, rules, mesh)
    if "mtp_weights" in prep:
        sums["mtp_tokens"] = prep["mtp_weights"].sum(axis=(1, 2))
    return sums


def make_eval_step(cfg: Config, mesh: Mesh, rules: ShardingRules):
    st_sh = state_shardings(cfg, mesh, rules)
    b_sh = batch_sharding(mesh, rules, (cfg.train.batch_size, cfg.train.seq_len))
    fn = functools.partial(eval_sums, cfg=cfg, rules=rules, mesh=mesh, context=mesh.shape["context"])
    return jax.jit(fn, in_shardings=(st_sh.params, {k: b_sh for k in BATCH_KEYS}))

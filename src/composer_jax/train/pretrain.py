"""The pretraining objective: next-token cross-entropy with z-loss, multi-token prediction (by
cross-entropy or by self-distillation from the main model), and DeepSeek-V3's sequence-wise
balance loss; plus the held-out evaluation sums of the same terms.

Context parallelism: when the sequence is split over C context devices, every [batch, seq] input
is permuted into the zigzag layout (`model.context_parallel.zigzag_permutation`) before the
split. Targets, MTP inputs and the distillation teacher's positions are computed before the
permutation; the model is told the original order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from composer_jax.config import Config, ModelConfig
from composer_jax.model.context_parallel import context_size, zigzag_permutation
from composer_jax.model.transformer import ModelOutput, forward, output_head
from composer_jax.sharding import MeshRules
from composer_jax.train import losses
from composer_jax.train.objective import Objective

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
SOURCE_KEY = "source_ids"  # 1 + each token's index in data.sources (data/pipeline.py), 0 = padding


def prepare_batch(batch: dict, num_mtp: int, context: int) -> dict:
    """Pipeline batch ([batch, seq] arrays) -> model inputs, targets and weights, in layout order."""
    tokens, seg = batch["tokens"].astype(jnp.int32), batch["segment_ids"].astype(jnp.int32)
    mask = batch["loss_mask"].astype(jnp.float32)
    b, s = tokens.shape
    targets, weights = losses.shifted_targets(tokens, seg, mask, 1)
    out = {
        "tokens": tokens,
        "segment_ids": seg,
        "positions": batch["positions"].astype(jnp.int32),
        "targets": targets,
        "weights": weights,
        "order": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
    }
    if SOURCE_KEY in batch:  # the target at i is token i + 1 of the same segment: the same source
        out[SOURCE_KEY] = batch[SOURCE_KEY].astype(jnp.int32)
    if num_mtp:
        shift = lambda x, k: jnp.concatenate([x[:, k:], jnp.zeros((b, k), x.dtype)], axis=1)
        out["mtp_tokens"] = jnp.stack([shift(tokens, k) for k in range(1, num_mtp + 1)])
        tw = [losses.shifted_targets(tokens, seg, mask, k + 1) for k in range(1, num_mtp + 1)]
        out["mtp_targets"] = jnp.stack([t for t, _ in tw])
        out["mtp_weights"] = jnp.stack([w for _, w in tw])
        # the main model's prediction at i+k is the distillation teacher of MTP depth k at i
        out["teacher_index"] = jnp.stack(
            [jnp.broadcast_to(jnp.minimum(jnp.arange(s) + k, s - 1), (b, s)) for k in range(1, num_mtp + 1)]
        ).astype(jnp.int32)
    if context > 1:
        perm = zigzag_permutation(s, context)
        inv = np.argsort(perm)
        for k, v in list(out.items()):
            if k == "teacher_index":
                v = jnp.asarray(inv)[v]  # original index -> position in the layout
            out[k] = jnp.take(v, jnp.asarray(perm), axis=v.ndim - 1)
    return out


def prepare(params: Any, batch: dict, cfg: Config, context: int) -> tuple[dict, dict]:
    """`prepare_batch` plus the whole-batch denominators: target tokens, sequences, MTP targets."""
    prep = prepare_batch(batch, cfg.model.num_mtp_layers if "mtp" in params else 0, context)
    denoms = {
        "tokens": jnp.maximum(prep["weights"].sum(), 1.0),
        "sequences": jnp.asarray(prep["tokens"].shape[0], jnp.float32),
    }
    if "mtp_weights" in prep:
        denoms["mtp_tokens"] = prep["mtp_weights"].sum(axis=(1, 2))
    return prep, denoms


def ce_chunks(shape: tuple[int, int], sharding: MeshRules | None, tokens_per_chunk: int = 512) -> int:
    """Sequence chunks for the fused cross-entropy: about `tokens_per_chunk` tokens of
    [tokens, vocab] logits live at a time (512 was fastest on a 2-core CPU at vocab 32000: one chunk
    of 4096 tokens took 2.6-3.7 s for head + loss + backward, 8 chunks about 1 s, and 256 or 1024
    tokens per chunk made the whole bench step 3-6% slower). With the sequence
    split over a context axis, one chunk (chunking would cut across the sharded axis)."""
    b, s = shape
    if context_size(sharding) > 1:
        return 1
    want = max(1, min(s, (b * s) // tokens_per_chunk))
    return max(c for c in range(1, want + 1) if s % c == 0)


def forward_microbatch(params: Any, mb: dict, m: ModelConfig, sharding: MeshRules | None, **inputs: Any) -> ModelOutput:
    """`forward` on one prepared micro-batch (what an objective's `prepare` wrote: tokens,
    segment_ids, positions and each token's original index `order`), in the zigzag layout when the
    context axis splits the sequence. `inputs`: the objective's own (mtp_tokens, routing)."""
    return forward(
        params,
        mb["tokens"],
        m,
        segment_ids=mb["segment_ids"],
        positions=mb["positions"],
        token_order=mb["order"],
        context_layout="zigzag" if context_size(sharding) > 1 else "contiguous",
        sharding=sharding,
        **inputs,
    )


def loss_terms(params: Any, mb: dict, cfg: Config, denoms: dict, sharding: MeshRules | None):
    """Objective for one micro-batch, normalised by whole-batch denominators, and metric sums."""
    m, t = cfg.model, cfg.train
    out = forward_microbatch(params, mb, m, sharding, mtp_tokens=mb.get("mtp_tokens"))
    # per-source sums of a mixture: group 0 is padding (no weight), group i source i
    groups = mb.get(SOURCE_KEY)
    by_source = {} if groups is None else {"groups": groups, "num_groups": len(cfg.data.sources) + 1}
    if out.mtp_logits is not None and t.mtp_loss == "self_distill":
        # the main logits are needed anyway (distillation teacher): plain cross-entropy on them
        nll, z, w, correct, *source_nll = losses.cross_entropy(
            out.logits, mb["targets"], mb["weights"], t.z_loss, **by_source
        )
        loss_sum = nll + z
    else:
        # fused head + cross-entropy (out.logits is then unused and dead-code-eliminated by jit);
        # the same numbers, ~3x faster on CPU (see losses.fused_linear_cross_entropy)
        chunks = ce_chunks(mb["tokens"].shape, sharding)
        loss_sum, nll, z, w, correct, *source_nll = losses.fused_linear_cross_entropy(
            out.hidden, output_head(params, m), mb["targets"], mb["weights"], t.z_loss, chunks, **by_source
        )
    objective = loss_sum / denoms["tokens"]
    sums = {"nll": nll, "z_loss": z, "tokens": w, "correct": correct}
    if groups is not None:
        sums["source_nll"] = source_nll[0][1:]
        sums["source_tokens"] = losses.grouped_sum(mb["weights"], groups, by_source["num_groups"])[1:]
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
    sums.update(moe_exchange_sums(out.aux))
    return objective, sums


def moe_exchange_sums(aux: dict) -> dict:
    """The expert-parallel exchange's statistics of `ModelOutput.aux` (main and MTP MoE layers),
    float32[layers] each, as sums the step accumulates over micro-batches and reports
    (`train.step.train_step`: moe_dropped, moe_a2a_bytes_per_device)."""
    keys = ("moe_dropped", "moe_a2a_rows", "mtp_moe_dropped", "mtp_moe_a2a_rows")
    return {k: aux[k] for k in keys if k in aux}


def metrics(sums: dict, denoms: dict, cfg: Config) -> dict:
    """Per-token means of the summed terms: nll, z-loss, accuracy; per MTP depth nll, accuracy, KL."""
    tokens = sums["tokens"]
    out = {
        "nll": sums["nll"] / jnp.maximum(tokens, 1.0),
        "z_loss": sums["z_loss"] / jnp.maximum(tokens, 1.0),
        "accuracy": sums["correct"] / jnp.maximum(tokens, 1.0),
        "tokens": tokens,
    }
    if "mtp_nll" in sums:
        mt = jnp.maximum(denoms["mtp_tokens"], 1.0)
        out["mtp_nll"] = sums["mtp_nll"] / mt
        out["mtp_accuracy"] = sums["mtp_correct"] / mt
        if "mtp_kl" in sums:
            out["mtp_kl"] = sums["mtp_kl"] / mt
    if "source_nll" in sums:  # a mixture: the nll of each source's target tokens, and their count
        out["source_nll"] = sums["source_nll"] / jnp.maximum(sums["source_tokens"], 1.0)
        out["source_tokens"] = sums["source_tokens"]
    return out


PRETRAINING = Objective(name="pretraining", batch_keys=BATCH_KEYS, prepare=prepare, terms=loss_terms, metrics=metrics)


def pretraining_objective(num_sources: int) -> Objective:
    """The pretraining objective for a run of `num_sources` data sources: with a mixture (two or
    more) the batch also carries each token's source (`source_ids`) and the metrics hold the nll
    and target tokens per source (`source_nll/i`, `source_tokens/i`: i = 1 + the index in
    data.sources), so a spike of the train loss can be told apart by source; the loss is the same."""
    if num_sources < 2:
        return PRETRAINING
    return dataclasses.replace(PRETRAINING, batch_keys=BATCH_KEYS + (SOURCE_KEY,))


def eval_sums(params: Any, prep: dict, cfg: Config, sharding: MeshRules | None) -> dict:
    """Held-out metric sums for one prepared batch: next-token nll / tokens / correct, and MTP per
    depth (the objective's terms with unit denominators, so the sums come back unscaled)."""
    denoms = {"tokens": jnp.ones(()), "sequences": jnp.ones(())}
    if "mtp_weights" in prep:
        denoms["mtp_tokens"] = jnp.ones((prep["mtp_weights"].shape[0],))
    _, sums = loss_terms(params, prep, cfg, denoms, sharding)
    if "mtp_weights" in prep:
        sums["mtp_tokens"] = prep["mtp_weights"].sum(axis=(1, 2))
    return sums

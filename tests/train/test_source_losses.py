"""Per-source losses of a data mixture: the pretraining objective of a run with two or more sources
also reports the nll of each source's target tokens (`source_nll/i`), checked against the model's
logits read directly; the loss and gradients are those of the plain objective."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.config import SourceConfig
from composer_jax.train.pretrain import PRETRAINING, pretraining_objective
from composer_jax.train.step import batch_gradients

TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"


def _cfg(micro: int, sources: int):
    cfg = cj.load_config(TINY, ["model.num_mtp_layers=0", f"train.micro_batches={micro}"], num_devices=None)
    srcs = tuple(SourceConfig(type="jsonl", path=f"s{i}.jsonl") for i in range(sources))
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=srcs))


def _batch(rows: int = 4, seq: int = 16) -> dict:
    """Two documents per row (a random cut), from sources 1..3; the first token of each is no target."""
    rng = np.random.default_rng(5)
    b = {k: np.zeros((rows, seq), np.int32) for k in ("tokens", "segment_ids", "positions", "source_ids")}
    b["tokens"] = rng.integers(0, 512, (rows, seq)).astype(np.int32)
    for r in range(rows):
        cut = int(rng.integers(3, seq - 3))
        b["segment_ids"][r] = np.where(np.arange(seq) < cut, 1, 2)
        b["positions"][r] = np.where(np.arange(seq) < cut, np.arange(seq), np.arange(seq) - cut)
        b["source_ids"][r] = np.where(np.arange(seq) < cut, *rng.integers(1, 4, 2))
    b["loss_mask"] = (b["positions"] > 0).astype(np.float32)
    return b


def _reference(params, batch, model_cfg, sources: int) -> tuple[np.ndarray, np.ndarray]:
    """(nll sum, target tokens) per source, from the logits: position i predicts token i + 1 of its segment."""
    logits = cj.forward(
        params,
        jnp.asarray(batch["tokens"]),
        model_cfg,
        segment_ids=jnp.asarray(batch["segment_ids"]),
        positions=jnp.asarray(batch["positions"]),
    ).logits
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1), np.float64)
    nll, count = np.zeros(sources), np.zeros(sources)
    rows, seq = batch["tokens"].shape
    for r in range(rows):
        for i in range(seq - 1):
            same = batch["segment_ids"][r, i + 1] == batch["segment_ids"][r, i]
            if same and batch["loss_mask"][r, i + 1] > 0:
                src = batch["source_ids"][r, i] - 1
                nll[src] -= logp[r, i, batch["tokens"][r, i + 1]]
                count[src] += 1
    return nll, count


@pytest.mark.parametrize("micro", [2])
def test_the_nll_per_source_is_the_logits_and_the_loss_is_unchanged(micro):
    cfg = _cfg(micro, sources=3)
    params = cj.init_params(cfg.model, jax.random.key(0))
    batch = _batch()
    mixed = pretraining_objective(3)
    assert mixed.batch_keys[-1] == "source_ids" and pretraining_objective(1) is PRETRAINING
    value, grads, sums, denoms = jax.jit(lambda p, b: batch_gradients(p, b, cfg, objective=mixed))(params, batch)
    plain = {k: v for k, v in batch.items() if k != "source_ids"}
    ref_value, ref_grads, ref_sums, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg))(params, plain)
    assert float(value) == float(ref_value) and float(sums["nll"]) == float(ref_sums["nll"])
    chex.assert_trees_all_equal(grads, ref_grads)
    nll, count = _reference(params, batch, cfg.model, 3)
    np.testing.assert_array_equal(np.asarray(sums["source_tokens"]), count)
    np.testing.assert_allclose(np.asarray(sums["source_nll"]), nll, rtol=1e-5)
    metrics = mixed.metrics(sums, denoms, cfg)
    np.testing.assert_allclose(np.asarray(metrics["source_nll"]), nll / np.maximum(count, 1), rtol=1e-5)
    # the sources' nll add up to the batch's
    np.testing.assert_allclose(float(np.sum(sums["source_nll"])), float(sums["nll"]), rtol=1e-5)

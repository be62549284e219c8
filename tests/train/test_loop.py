"""The stage loop: kill-and-resume continues the loss curve exactly; NaN steps are skipped."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.train.loop import run_stage

REPO = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, name, extra=()):
    return cj.load_config(
        REPO / "configs/pretrain/tiny_stage1.yaml",
        [
            "model.num_layers=2",
            "model.num_mtp_layers=1",
            "train.seq_len=64",
            "train.batch_size=8",
            "train.steps=6",
            "train.eval_every=100",
            "train.eval_batches=1",
            "train.log_every=1",
            "train.tensorboard=false",
            "train.mtp_weight=0.3",
            f"train.out_dir={tmp_path / name}",
            "checkpoint.save_every=2",
            "checkpoint.async_save=true",
            "train.peak_tflops=1.0",
            *extra,
        ],
        num_devices=8,
    )


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # data paths in the stage configs are relative to the repository


# Slow (82 s on 2 cores: three runs of the stage). The default suite keeps resumption exact piecewise:
# the data pipeline's state (tests/data/test_pipeline.py::test_exact_resume_from_json_state), the
# checkpoint round trip (tests/checkpoint/) and the RL learner's resume (tests/rl/test_async_resume.py).
@pytest.mark.slow
def test_kill_and_resume_is_bit_exact(tmp_path, in_repo):
    full = run_stage(_cfg(tmp_path, "full"), echo=lambda s: None)
    first = run_stage(_cfg(tmp_path, "killed"), stop_after=3, echo=lambda s: None)  # last checkpoint: step 2
    assert first["stopped_at"] == 3
    resumed = run_stage(_cfg(tmp_path, "killed"), echo=lambda s: None)
    assert resumed["start_step"] == 2
    for step in range(3, 7):
        assert resumed["losses"][step] == full["losses"][step], (step, resumed["losses"], full["losses"])
    assert first["losses"][3] == full["losses"][3]
    # the loss moved (the comparison is not between constant curves)
    assert full["losses"][6] != full["losses"][1]
    # stage 1's mixture (src, tests, docs): each source's nll is logged under its name, and resumes exactly
    assert set(full["source_losses"]) == {"src", "tests", "docs"}
    assert resumed["source_losses"]["src"][5] == full["source_losses"]["src"][5]
    logged = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in logged if "source_nll/src" in r)
    assert {"source_tokens/src", "source_tokens/tests", "source_tokens/docs"} <= set(step)


def test_nonfinite_step_is_skipped(tmp_path):
    from composer_jax.train.state import init_train_state
    from composer_jax.train.step import make_train_step

    cfg = _cfg(tmp_path, "nan")
    mesh = cj.make_mesh(cfg.mesh)
    rules = cj.ShardingRules.create()
    state = init_train_state(cfg, mesh, rules)
    state.params["final_norm"] = state.params["final_norm"].at[0].set(jnp.nan)
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    step = make_train_step(cfg, mesh, rules)
    batch = {
        "tokens": np.ones((8, 64), np.int32),
        "segment_ids": np.ones((8, 64), np.int32),
        "positions": np.tile(np.arange(64, dtype=np.int32), (8, 1)),
        "loss_mask": np.ones((8, 64), np.float32),
    }
    with jax.set_mesh(mesh):
        new, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(new.params), before):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert int(new.step) == 1

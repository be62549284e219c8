"""The RL learner with `train.lora`: what a step changes, what a checkpoint holds, what a resume
restores and what a publish writes.

The slow test runs one learner step (test_learner_step.py's in-process stand-in for the rollout
side) and checks all of it end to end; the default test keeps the checkpoint, resume and publish
halves without compiling a train step (the train step's "adapters move, the base does not" stays
in tests/model/test_lora.py's slow `test_train_step_moves_only_the_adapters` and here).

The publish relation checked (`_check_publish`): the version's manifest lists exactly the
adapter leaves (path, shape, dtype; no base leaf), each leaf's `raw_bytes` is that adapter
array's nbytes, so the manifest's `raw_bytes` equals `lora.adapter_bytes(adapters)` exactly; the
store's files for the version are its leaves' `stored_bytes` (zstd-compressed zarr3 chunks and
each array's zarr.json) plus manifest.json, at most raw_bytes + 1 KiB per leaf + the manifest:
the store's own format overhead; and the weights read back from the store are the adapters, bit
for bit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO
from support.lora_run import lora_config, save_lora_run
from support.rl_groups import make_group

from composer_jax.checkpoint.manager import TrainCheckpointer, saved_leaves
from composer_jax.config import to_dict
from composer_jax.model import lora
from composer_jax.rl.restore import restore_or_init
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.loop import run_checkpoint_config
from composer_jax.weightsync.publisher import store_publisher
from composer_jax.weightsync.store import open_store, read_manifest, version_dir
from composer_jax.weightsync.subscriber import VersionReader

PER_LEAF_OVERHEAD = 1024  # zarr.json + zstd framing of one leaf, bytes (an upper bound)


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(x) for p, x in _leaves(tree)}


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(jax.device_get(tree))


def _equal(a, b) -> bool:
    fa, fb = _flat(a), _flat(b)
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


def _check_checkpoint(ckpt_dir: Path, step: int, adapters, base) -> None:
    """The step's saved train state: the adapters under params/, AdamW's moments shaped like them,
    scalars; not one leaf shaped like a base weight, no frozen/ subtree."""
    saved = saved_leaves(ckpt_dir, step)
    params = {k.removeprefix("params/"): v[0] for k, v in saved.items() if k.startswith("params/")}
    assert params == {k: x.shape for k, x in _flat(adapters).items()}
    assert not any(k.startswith("frozen") for k in saved), sorted(saved)[:5]
    adapter_shapes = set(params.values())
    opt = {k: v[0] for k, v in saved.items() if k.startswith("opt_state/")}
    assert all(shape in adapter_shapes or len(shape) == 0 for shape in opt.values()), opt
    assert sum(1 for shape in opt.values() if shape) == 2 * len(params)  # AdamW's mu and nu
    base_shapes = {x.shape for x in _flat(base).values()}
    assert not (base_shapes & {v[0] for v in saved.values()} - adapter_shapes - {()})
    held = sum(int(np.prod(v[0])) * np.dtype(v[1]).itemsize for v in saved.values())
    assert held < 3 * lora.adapter_bytes(adapters) + 4096 < lora.adapter_bytes(base)


def _check_publish(store_url: str, version: int, adapters) -> dict:
    """The module docstring's relation, for `version`; returns its manifest."""
    store = open_store(store_url)
    m = read_manifest(store, version)
    flat = _flat(adapters)
    assert [(e["path"], e["dtype"], tuple(e["shape"])) for e in m["leaves"]] == [
        (p, x.dtype.name, x.shape) for p, x in flat.items()
    ]
    assert [e["raw_bytes"] for e in m["leaves"]] == [x.nbytes for x in flat.values()]
    assert m["raw_bytes"] == lora.adapter_bytes(adapters)
    root = Path(store_url.removeprefix("file://")) / version_dir(version)
    on_disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    manifest = (root / "manifest.json").stat().st_size
    assert on_disk == m["stored_bytes"] + manifest + m.get("delta", {}).get("stored_bytes", 0)
    assert m["stored_bytes"] <= m["raw_bytes"] + PER_LEAF_OVERHEAD * len(flat)
    back = VersionReader(store).views(version)
    assert back.keys() == flat.keys() and all(np.array_equal(back[k], flat[k]) for k in flat)
    return m


def test_lora_checkpoint_resume_and_publish_without_a_step(tmp_path, monkeypatch) -> None:
    """A LoRA state's checkpoint holds the adapters and their optimiser state only; a resume from
    it restores them (bit for bit) and loads the base again from the run's seed; a publish is the
    adapters' bytes (module docstring). (The train step itself: the slow test below.)"""
    monkeypatch.chdir(REPO)
    cfg, state = save_lora_run(tmp_path / "run", step=3, move=False)  # the learner's fresh state
    checkpointer = TrainCheckpointer(run_checkpoint_config(cfg))
    _check_checkpoint(Path(checkpointer.config.directory), 3, state.params, state.frozen)
    mesh, rules = make_mesh(cfg.mesh), ShardingRules.create(cfg.sharding_rules)
    again = restore_or_init(cfg, mesh, rules, checkpointer, run_config=to_dict(cfg), echo=lambda _: None)
    assert again.resumed and again.step == 3
    assert _equal(again.state.params, state.params) and _equal(again.state.opt_state, state.opt_state)
    assert _equal(again.state.frozen, state.frozen)  # the same base, from train.seed
    checkpointer.close()

    url = f"file://{tmp_path / 'store'}"
    publish = store_publisher(url, resumed=False, start=0, dtype="", echo=lambda _: None)
    publish(state.params, 0)
    m = _check_publish(url, 0, state.params)
    assert m["raw_bytes"] * 20 < lora.adapter_bytes(state.frozen)


class _StandIn:
    """test_learner_step.py's stand-in rollout side, reduced to what one step asks."""

    def __init__(self, groups):
        self.groups, self.handed = list(groups), []
        self.next_index = max(g.index for g in groups) + 1

    def start_queue(self) -> None:
        pass

    async def take(self, step, fits):
        taken = [g for g in self.groups if fits([], g)][:2]
        self.groups = [g for g in self.groups if g not in taken]
        return taken, []

    def finished_untrained(self):
        return {"dropped_stale_groups": [], "lost_groups": []}

    def queue_values(self):
        return {}

    async def hand_over(self, params, version, trained) -> None:
        self.handed.append((version, params))


# slow: 25-30 s (the learner's train step compiles); the default suite keeps the checkpoint, resume
# and publish halves in `test_lora_checkpoint_resume_and_publish_without_a_step`
@pytest.mark.slow
def test_lora_learner_step_checkpoint_resume_and_publish(tmp_path, monkeypatch) -> None:
    """One learner step with train.lora: the base leaves stay bit-identical, every B (zero at the
    start) moves; version 1 in the weight store is the adapters' bytes (module docstring) while the
    in-process samplers get the merged model; the checkpoint holds the adapters and their moments
    only, and a resume restores them and reloads the same base."""
    from composer_jax.rl.learner import Learner

    monkeypatch.chdir(REPO)
    url = f"file://{tmp_path / 'store'}"
    cfg = lora_config(tmp_path / "run", ["train.steps=1", f"rl.weight_store={url}"])
    learner = Learner(cfg, echo=lambda _line: None)
    base0, adapters0 = jax.device_get(learner.state.frozen), jax.device_get(learner.state.params)
    groups = [make_group(0, [[0] * 6] * 4), make_group(1, [[0] * 5] * 4)]
    layers, k, experts = cfg.model.num_moe_layers, cfg.model.num_experts_per_tok, cfg.model.num_experts
    for g in groups:
        for i, r in enumerate(g.rollouts):
            gen = r.generations[0]
            # distinct tokens per rollout (make_group's are equal: a group's advantages would cancel
            # in the loss to exactly zero), and router replay's recorded experts
            gen.tokens = [t + 7 * i for t in gen.tokens]
            n = len(gen.tokens)
            gen.routing = (np.arange(n * layers * k, dtype=np.int32) % experts).reshape(n, layers, k)
    side = _StandIn(groups)
    learner.attach(side)  # type: ignore[arg-type]
    asyncio.run(learner.before_steps())  # publishes version 0
    asyncio.run(learner.step(0))

    state = learner.state
    assert _equal(state.frozen, base0), "the step changed the frozen base"
    before, after = _flat(adapters0), _flat(state.params)
    moved = {p for p in before if not np.array_equal(before[p], after[p])}
    assert {p for p in before if p.endswith("/b")} <= moved  # B from zero (A's gradient is 0 while B = 0)
    assert side.handed[0][0] == 1
    merged = lora.merged(state.frozen, state.params, cfg.train.lora.scale)
    assert _equal(side.handed[0][1], merged)  # the in-process samplers: the merged model

    m0, m1 = _check_publish(url, 0, adapters0), _check_publish(url, 1, state.params)
    assert m1["kind"] == "delta" and m1["parent_version"] == 0 and m0["kind"] == "base"
    print(
        f"[lora] adapters {lora.adapter_bytes(state.params)} B, base {lora.adapter_bytes(state.frozen)} B; "
        f"store: v0 {m0['stored_bytes']} B, v1 {m1['stored_bytes']} B stored"
    )

    learner.checkpoint(1, force=True)
    learner.close()
    _check_checkpoint(Path(learner.checkpointer.config.directory), 1, state.params, state.frozen)

    resumed = Learner(cfg, echo=lambda _line: None)
    assert resumed.begin.resumed and resumed.begin.step == 1
    assert _equal(resumed.state.params, state.params) and _equal(resumed.state.opt_state, state.opt_state)
    assert _equal(resumed.state.frozen, base0)
    resumed.close()


# slow: 40-60 s (a 2-step run: the learner's step and the in-process sampler compile); the default
# suite keeps the quantised base's forward (= the dequantised base's, exactly) in
# tests/model/test_quant_base.py and the export's dequantised base in tests/hf/test_lora_convert.py
@pytest.mark.slow
@needs_bwrap
def test_lora_run_over_a_quantised_base_samples_what_it_trains(tmp_path, monkeypatch) -> None:
    """train.lora.base_format=mxfp8 with the in-process sampler: the trainer computes over the
    base's codes, the sampler gets the merged model over the dequantised base (the same numbers),
    so the mismatch KL between the sampler's and the trainer's log-probabilities stays ~0; the
    checkpoint holds the adapters and their moments only."""
    from composer_jax.rl.learner import run_rl

    monkeypatch.chdir(REPO)
    cfg = lora_config(tmp_path / "run", ["train.steps=2", "train.lora.base_format=mxfp8"])
    summary = run_rl(cfg, echo=lambda _: None)
    assert summary["final_step"] == 2 and not summary["lost_groups"]
    kls = [v["mismatch_kl_k1"] for v in summary["steps"].values()]
    print(f"[qlora] mismatch KL k1 per step: {kls}")
    for n, v in summary["steps"].items():
        assert v["version_lag_max"] == 0 and abs(v["mismatch_kl_k1"]) < 1e-4, (n, v)
    saved = saved_leaves(Path(run_checkpoint_config(cfg).directory), 2)
    assert not any(k.startswith("frozen") for k in saved)
    adapters = lora.abstract_adapters(cfg.model, cfg.train.lora)
    params = {k for k in saved if k.startswith("params/")}
    assert len(params) == len(jax.tree.leaves(adapters))

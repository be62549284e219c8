"""The asynchronous learner end to end (tiny model, real environment server): rollouts run ahead
of the trainer within the staleness bound, one of the two samplers dies mid-run and its rollouts
are redone on the other, the trainer stops mid-run after an uncheckpointed step and a restart
from the last checkpoint uses every group id exactly once in the surviving lineage: the persisted
groups first (those staler than the restarted run's bound dropped and counted), the ones that were
in flight, or sampled by the lost step's weights, sampled again."""

from __future__ import annotations

import collections
import json

import jax
import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

from composer_jax.checkpoint.manager import restore_params_only
from composer_jax.config import load_config
from composer_jax.model.params import abstract_params
from composer_jax.rl import learner as trainer
from composer_jax.rl.rollout.group_store import GroupStore
from composer_jax.rl.samplers.policy import SamplerUnavailable
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.weightsync.store import tree_sha256
from composer_jax.weightsync.subscriber import WeightSubscriber

# two learner runs of 3 and 2 steps: about a minute on 2 idle cores, so slow (the resume logic's
# parts have fast tests: tests/rl/rollout/test_rollout_queue.py and test_weight_sync.py)
pytestmark = [
    needs_bwrap,
    pytest.mark.slow,
]


class DiesAfter:
    """A sampler that serves `turns` turns, then dies: the turn in progress is lost, and every later
    call fails, as a dead sampler process's would."""

    def __init__(self, inner, turns: int):
        self.inner, self.left, self.max_context, self.failures = inner, turns, inner.max_context, 0

    def begin(self, messages, tools=None):
        return self.inner.begin(messages, tools)

    def extend(self, gen, messages):
        self.inner.extend(gen, messages)

    async def turn(self, gen, req):
        self.left -= 1
        if self.left < 0:
            self.failures += 1
            if self.left == -1:
                await self.inner.turn(gen, req)  # the replica dies before its answer arrives
            raise SamplerUnavailable("sampler replica died")
        return await self.inner.turn(gen, req)


def done_ids(checkpoints, step: int) -> set[int]:
    """The group ids the checkpoint at `step` records as done (trained or dropped), read from its
    data-state JSON as written (`{"next_group": ..., "done": {"below": B, "extra": [...]}}`)."""
    done = json.loads((checkpoints / str(step) / "data_state" / "metadata").read_text())["done"]
    return set(range(done["below"])) | set(done["extra"])


def test_async_run_survives_a_dead_sampler_and_a_restart_training_each_group_once(tmp_path, monkeypatch) -> None:
    """Exactly once, in the surviving lineage: the first run trains steps 1-3 and stops before the
    checkpoint of step 3 (as a kill would), so step 3's weights die with it; the restart resumes
    from the checkpoint of step 2. The lineage that survives is the checkpoint's done ids plus what
    the second run trains or drops: each id appears once there, the ids the lost step trained are
    trained (or dropped) again, and no id is lost."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    store_url = f"file://{tmp_path / 'weights'}"
    base = [
        f"train.out_dir={out}",
        "train.steps=4",
        "checkpoint.save_every=2",
        "rl.eval_tasks=[]",
        f"rl.weight_store={store_url}",
    ]
    dying: list[DiesAfter] = []
    in_process_samplers, sample_group = trainer.in_process_samplers, trainer.sample_group

    def two_samplers(*a, **k):
        samplers = in_process_samplers(*a, **k)
        [policy] = samplers.policies
        dying.append(DiesAfter(policy, 3))
        samplers.policies = [dying[-1], policy]
        return samplers

    sizes: dict[int, int] = {}

    async def recorded(pool, client, cfg, index):
        group = await sample_group(pool, client, cfg, index)
        sizes[group.index] = len(group.rollouts)
        return group

    monkeypatch.setattr(trainer, "in_process_samplers", two_samplers)
    monkeypatch.setattr(trainer, "sample_group", recorded)
    cfg = load_config("tests/rl/fixtures/rl_pick.yaml", [*base, "rl.max_staleness=2"])
    first = trainer.run_rl(cfg, echo=lambda _: None, stop_after=3)
    assert first["stopped_at"] == 3 and sorted(first["trained_groups"]) == [1, 2, 3]
    assert not first["dropped_stale_groups"] and not first["lost_groups"]
    # the dead sampler cost only its rollouts in flight: every group has all 4 scored rollouts
    assert dying[0].failures >= 1 and set(sizes.values()) == {4}
    for n, step in first["steps"].items():
        assert step["version_lag_max"] <= 2 and step["staleness/max"] <= 2, (n, step)
        assert step["rollout/groups"] == 2.0 and step["rollout/env_failures"] == 0.0
    assert first["steps"][1]["version_lag_max"] == 0  # nothing is older than the first version
    checkpoints = out / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2]
    kept = first["trained_groups"][1] + first["trained_groups"][2]
    lost_step = first["trained_groups"][3]  # trained, but its weights died with the first run
    assert done_ids(checkpoints, 2) == set(kept)

    store = GroupStore(out / "rollouts")
    persisted = {i: store.load(i).version for i in store.indices()}
    assert not set(persisted) & set(kept)  # files of checkpointed groups went with the checkpoint
    assert set(lost_step) <= set(persisted)  # the lost step's groups wait on disk for the restart
    sub = WeightSubscriber(store_url)
    assert sub.versions() == [0, 1, 2, 3]

    monkeypatch.setattr(trainer, "in_process_samplers", in_process_samplers)
    cfg = load_config("tests/rl/fixtures/rl_pick.yaml", [*base, "rl.max_staleness=0", "rl.staleness_unit=group"])
    said: list[str] = []
    second = trainer.run_rl(cfg, echo=said.append)
    assert "[rl] weight store rewound to version 2: versions [3] were of the lost run" in said
    assert second["start_step"] == 2 and sorted(second["trained_groups"]) == [3, 4]
    for n in (3, 4):
        assert second["steps"][n]["staleness/max"] == 0 and second["steps"][n]["version_lag_max"] == 0
    # persisted groups sampled before version 2 are too stale for the bound 0 at version 2: dropped
    assert second["dropped_stale_groups"] == sorted(i for i, v in persisted.items() if v < 2)
    assert not second["lost_groups"]

    trained_second = [i for ids in second["trained_groups"].values() for i in ids]
    lineage = kept + trained_second + second["dropped_stale_groups"]
    uses = collections.Counter(lineage)
    assert max(uses.values()) == 1, uses  # no id twice in the surviving lineage
    assert len(kept + trained_second) == 8  # 4 steps x 2 groups
    assert set(lost_step) <= set(trained_second) | set(second["dropped_stale_groups"])
    # the final checkpoint records exactly the lineage; no id below the highest used is lost:
    # each is done there or waits on disk for a later run
    final = done_ids(checkpoints, 4)
    assert final == set(lineage)
    assert set(range(max(lineage) + 1)) <= final | set(store.indices())
    assert not set(store.indices()) & final  # done groups' files are gone
    # the store's versions 3 and 4 are the surviving lineage's (3 written anew), 4 bit-exactly the
    # trained weights
    sub = WeightSubscriber(store_url)
    assert sub.versions() == [0, 1, 2, 3, 4]
    params = restore_params_only(checkpoints, abstract_params(cfg.model, make_mesh(cfg.mesh), ShardingRules.create()))
    assert tree_sha256(sub.read(4)[1]) == tree_sha256(jax.device_get(params))
    print("trained:", first["trained_groups"], second["trained_groups"], "persisted (id: version):", persisted)

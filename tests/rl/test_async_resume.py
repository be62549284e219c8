"""The asynchronous learner end to end (tiny model, real environment server): rollouts run ahead
of the trainer within the staleness bound, one of the two samplers dies mid-run and its rollouts
are redone on the other, the trainer stops mid-run and a restart trains every group id exactly
once across both runs: the persisted groups first (those staler than the restarted run's bound
dropped and counted), the ones that were in flight sampled again."""

from __future__ import annotations

import collections

import jax
import pytest
from live_env import HAVE_BWRAP, REPO

from composer_jax.checkpoint.manager import restore_params_only
from composer_jax.checkpoint.weight_sync import WeightSubscriber, tree_sha256
from composer_jax.config import load_config
from composer_jax.model.params import abstract_params
from composer_jax.rl import trainer
from composer_jax.rl.policy import SamplerUnavailable
from composer_jax.rl.rollout_store import GroupStore
from composer_jax.sharding import ShardingRules, make_mesh

pytestmark = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) is not installed; `make system-deps`")


class DiesAfter:
    """A sampler that serves `turns` turns, then dies: the turn in progress is lost, and every later
    call fails, as a dead sampler process's would."""

    def __init__(self, inner, turns: int):
        self.inner, self.left, self.max_context, self.failures = inner, turns, inner.max_context, 0

    def begin(self, messages):
        return self.inner.begin(messages)

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


def test_async_run_survives_a_dead_sampler_and_a_restart_training_each_group_once(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    store_url = f"file://{tmp_path / 'weights'}"
    base = [f"train.out_dir={out}", "train.steps=3", "rl.eval_tasks=[]", f"rl.weight_store={store_url}"]
    dying: list[DiesAfter] = []
    make_policies, sample_group = trainer.make_policies, trainer.sample_group

    def two_samplers(*a, **k):
        [policy] = make_policies(*a, **k)
        dying.append(DiesAfter(policy, 3))
        return [dying[-1], policy]

    sizes: dict[int, int] = {}

    async def recorded(pool, client, cfg, index):
        group = await sample_group(pool, client, cfg, index)
        sizes[group.index] = len(group.rollouts)
        return group

    monkeypatch.setattr(trainer, "make_policies", two_samplers)
    monkeypatch.setattr(trainer, "sample_group", recorded)
    cfg = load_config("tests/rl/fixtures/rl_pick.yaml", [*base, "rl.max_staleness=2"])
    first = trainer.run_rl(cfg, echo=lambda _: None, stop_after=2)
    assert first["stopped_at"] == 2 and sorted(first["trained_groups"]) == [1, 2]
    # the dead sampler cost only its rollouts in flight: every group has all 4 scored rollouts
    assert dying[0].failures >= 1 and set(sizes.values()) == {4}
    for n, step in first["steps"].items():
        assert step["version_lag_max"] <= 2 and step["staleness/max"] <= 2, (n, step)
        assert step["rollout/groups"] == 2.0 and step["rollout/env_failures"] == 0.0
    assert first["steps"][1]["version_lag_max"] == 0  # nothing is older than the first version

    store = GroupStore(out / "rollouts")
    trained_first = [i for ids in first["trained_groups"].values() for i in ids]
    persisted = {i: store.load(i).version for i in store.indices()}
    assert not set(persisted) & set(trained_first)  # files of trained groups went with the checkpoint
    # with s = 2 six groups start at version 0 and two are trained per step: the two left over
    # finish while the first steps train (their rollouts take far less than a step) and wait on disk
    assert persisted, "no finished group was waiting when the trainer stopped"

    monkeypatch.setattr(trainer, "make_policies", make_policies)
    cfg = load_config("tests/rl/fixtures/rl_pick.yaml", [*base, "rl.max_staleness=0", "rl.staleness_unit=group"])
    second = trainer.run_rl(cfg, echo=lambda _: None)
    assert second["start_step"] == 2 and sorted(second["trained_groups"]) == [3]
    step = second["steps"][3]
    assert step["staleness/max"] == 0 and step["version_lag_max"] == 0
    # persisted groups sampled before version 2 are too stale for the bound 0 at version 2: dropped
    assert second["dropped_stale_groups"] == sorted(i for i, v in persisted.items() if v < 2)
    assert step["rl/dropped_stale_groups"] == len(second["dropped_stale_groups"])

    trained_second = second["trained_groups"][3]
    uses = collections.Counter(trained_first + trained_second + second["dropped_stale_groups"])
    assert len(trained_first + trained_second) == 6 and max(uses.values()) == 1, uses
    # every persisted group was trained or dropped; every trained or dropped group's file is gone
    assert set(persisted) <= set(uses) and not set(store.indices()) & set(uses)
    # every version went to the weight store, the last one bit-exactly the trained weights
    sub = WeightSubscriber(store_url)
    assert sub.versions() == [0, 1, 2, 3]
    params = restore_params_only(
        out / "checkpoints", abstract_params(cfg.model, make_mesh(cfg.mesh), ShardingRules.create())
    )
    assert tree_sha256(sub.read(3)[1]) == tree_sha256(jax.device_get(params))
    print("trained:", first["trained_groups"], second["trained_groups"], "persisted (id: version):", persisted)

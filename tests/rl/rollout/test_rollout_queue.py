"""The rollout queue's scheduling and bookkeeping, without a model: groups are made by a simulated
sampler that stamps every token with the policy version current when it is generated (as the
in-process sampler does after an in-flight `update_weights`), so staleness is counted from the
tokens themselves. The persisted-group files round-trip exactly, and the done-id set is compact."""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

import numpy as np
import pytest
from support.rl_groups import make_group

from composer_jax.rl.rollout.group_store import Group, GroupStore, RolloutStoreError
from composer_jax.rl.rollout.ledger import resume_groups
from composer_jax.rl.rollout.queue import DoneIds, RolloutQueue, staleness
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable


def test_token_versions_count_only_policy_tokens() -> None:
    """The prompt's -1 versions are not policy tokens; a group with none falls back to its own version."""
    g = make_group(0, [[4, 5, 7], [5, 6]])
    assert g.oldest_token_version() == 4 and g.newest_token_version() == 7
    np.testing.assert_array_equal(np.sort(g.policy_token_versions()), [4, 5, 5, 6, 7])
    for r in g.rollouts:  # mask every generated token off: no policy tokens left
        r.generations[0].loss_mask = [0.0] * len(r.generations[0].loss_mask)
    assert g.oldest_token_version() == g.newest_token_version() == g.version == 4
    g.version = 9  # a group stamped newer than its tokens reports that version as its newest
    g.rollouts[0].generations[0].loss_mask[-1] = 1.0
    assert g.oldest_token_version() == 7 and g.newest_token_version() == 9


def test_done_ids_are_compact_and_refuse_a_second_use():
    done = DoneIds()
    for i in (2, 0, 5, 1):
        done.add(i)
    assert done.state() == {"below": 3, "extra": [5]}
    assert 1 in done and 5 in done and 3 not in done and 4 not in done
    with pytest.raises(ValueError, match="group 5 is already done"):
        done.add(5)
    again = DoneIds.from_state(done.state())
    assert again.state() == done.state()
    with pytest.raises(ValueError, match="done-groups state"):
        DoneIds.from_state({"below": 4, "extra": [2]})


def test_group_store_round_trips_a_group_exactly(tmp_path):
    store = GroupStore(tmp_path)
    g = make_group(7, [[3, 3, 4], [4, 5]], routing=True)
    g.failed = 1
    store.save(g)
    assert store.indices() == [7] and [p.name for p in tmp_path.iterdir()] == ["group_00000007.npz"]
    back = store.load(7)
    assert (back.index, back.task, back.failed, back.version) == (7, g.task, 1, 3)
    assert back.rewards == g.rewards
    for a, b in zip(back.rollouts, g.rollouts):
        assert (a.seed, a.grade, a.turns, a.finish_reason, a.generated_tokens) == (
            b.seed,
            b.grade,
            b.turns,
            b.finish_reason,
            b.generated_tokens,
        )
        ga, gb = a.generations[0], b.generations[0]
        assert ga.tokens == gb.tokens and ga.loss_mask == gb.loss_mask and ga.versions == gb.versions
        np.testing.assert_array_equal(np.float32(ga.logprobs), np.float32(gb.logprobs))
        np.testing.assert_array_equal(ga.routing, gb.routing)
        assert ga.messages == gb.messages
    assert back.oldest_token_version() == 3 and staleness(back, 6, "token") == 3
    store.path(8).write_bytes(b"not a zip")
    with pytest.raises(RolloutStoreError, match="group_00000008.npz: not a readable persisted group"):
        store.load(8)
    store.remove([7, 8])
    assert store.indices() == []


def test_staleness_units():
    g = make_group(0, [[2, 3], [4]])
    g.version = 1  # started at 1, its first token came after the update to 2
    assert staleness(g, 5, "token") == 3 and staleness(g, 5, "group") == 4


class SimulatedSampler:
    """Generates each rollout token by token; every token gets the current policy version."""

    def __init__(self, rng: random.Random, slow: set[int]):
        self.version, self.rng, self.slow = 0, rng, slow
        self.running = self.most_running = 0

    async def sample(self, index: int, version: int) -> Group:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            return await self._sample(index)
        finally:
            self.running -= 1

    async def _sample(self, index: int) -> Group:
        async def rollout() -> list[int]:
            vs = []
            for _ in range(self.rng.randint(2, 6) * (8 if index in self.slow else 1)):
                await asyncio.sleep(0)
                vs.append(self.version)
            return vs

        return make_group(index, list(await asyncio.gather(*(rollout() for _ in range(2)))))


def simulate(s: int, unit: str, *, steps=12, gps=3, ready=(), seed=0, in_flight=0) -> dict:
    async def main() -> dict:
        rng = random.Random(seed)
        sim = SimulatedSampler(rng, slow={1, 5, 9})
        persisted: list[int] = []

        async def persist(g):
            persisted.append(g.index)

        q = RolloutQueue(
            sample=sim.sample,
            persist=persist,
            order=iter(range(100, 10_000)) if ready else iter(range(10_000)),
            ready=list(ready),
            version=0,
            groups_per_step=gps,
            max_staleness=s,
            unit=unit,
            max_in_flight=in_flight,
            budget=steps * gps,
        )
        q.start()
        trained, lags, dropped = [], [], []
        for k in range(steps):
            groups, stale = await q.take(k, lambda taken, g: True)
            dropped += [(g.index, staleness(g, k, unit)) for g in stale]
            for g in groups:
                trained.append(g.index)
                lags.append(staleness(g, k, unit))
                tokens = [v for r in g.rollouts for v in r.generations[0].versions if v >= 0]
                lags.append(k - min(tokens) if unit == "token" else k - g.version)
            for _ in range(rng.randint(1, 20)):  # the train step: samplers keep going meanwhile
                await asyncio.sleep(0)
            sim.version = k + 1
            q.advance(k + 1, len(groups))
        await q.aclose()
        return {
            "trained": trained,
            "lags": lags,
            "dropped": dropped,
            "persisted": persisted,
            "q": q,
            "most_running": sim.most_running,
        }

    return asyncio.run(main())


@pytest.mark.parametrize("unit", ["token", "group"])
@pytest.mark.parametrize("s", [0, 1, 3])
def test_no_trained_group_is_staler_than_the_bound(s, unit):
    for seed in range(3):
        out = simulate(s, unit, seed=seed)
        assert len(out["trained"]) == 12 * 3 and len(set(out["trained"])) == len(out["trained"])
        assert max(out["lags"]) <= s and out["dropped"] == []
        assert set(out["trained"]) <= set(out["persisted"])  # every trained group was persisted first
        if s == 0:  # the synchronous learner: one step's groups, in order, all at the step's version
            assert out["trained"] == list(range(36)) and set(out["lags"]) == {0}
        else:  # the producer runs ahead: some groups are trained at a later version than they started
            assert max(out["lags"]) >= 1


@pytest.mark.parametrize("unit", ["token", "group"])
def test_stale_persisted_groups_are_dropped_counted_and_replaced(unit):
    # groups persisted by an earlier run, sampled at versions -3..0 (trained now at version 0 onward)
    old = [make_group(90 + i, [[-i, 0], [0, 0]]) for i in range(4)]
    out = simulate(1, unit, steps=4, gps=2, ready=old)
    want = {90 + i for i in range(4) if i > 1}  # staleness at version 0 is i, the bound 1
    assert {i for i, _ in out["dropped"]} == want and all(lag > 1 for _, lag in out["dropped"])
    assert len(out["trained"]) == 8 and len(set(out["trained"])) == 8 and max(out["lags"]) <= 1
    assert set(out["trained"]) & want == set() and {90, 91} <= set(out["trained"])
    assert out["q"].dropped_stale == sorted(want)


def test_in_flight_bound_is_kept():
    out = simulate(3, "token", in_flight=2, steps=6)
    assert len(out["trained"]) == 18 and max(out["lags"]) <= 3 and out["most_running"] == 2
    assert simulate(3, "token", steps=6)["most_running"] == 3 * 4  # default: (s + 1) x groups_per_step


def test_pool_redoes_work_on_another_policy_and_drops_the_dead_one() -> None:
    class Dies:
        def __repr__(self):
            return "dies"

    class Lives:
        pass

    dead, alive = cast(Any, Dies()), cast(Any, Lives())  # stand-ins: the pool only hands them to `work`
    pool = PolicyPool([dead, alive])
    calls: list[object] = []

    async def work(p):
        calls.append(p)
        if p is dead:
            raise SamplerUnavailable("replica gone")
        return "ok"

    async def main():
        return [await pool.run(work) for _ in range(4)]

    assert asyncio.run(main()) == ["ok"] * 4
    assert calls == [dead, alive, alive, alive, alive] and pool.alive == [alive]
    pool.remove(alive, "also gone")
    with pytest.raises(RuntimeError, match="every sampler is unavailable .*dies: replica gone; .*: also gone"):
        pool.pick()


def test_resume_keeps_the_checkpointed_lineage_and_samples_lost_groups_again(tmp_path) -> None:
    """Resuming from the checkpoint of version 2 (groups 0-3 done): files of done groups go; a group
    with a token of version 3 (the stopped run's, lost with it) or started at 3 is sampled again,
    as are ids in flight (no file) and a corrupt file; groups of versions <= 2 are loaded to train."""
    store = GroupStore(tmp_path)
    for g in (
        make_group(1, [[0, 0], [0, 1]]),  # done: its file goes
        make_group(4, [[1, 1], [2, 2]]),  # version <= 2: trained after the restart
        make_group(5, [[2, 3], [2, 2]]),  # a version-3 token: the lost run's weights made it
        make_group(6, [[3, 3], [3, 3]]),  # started on version 3
        make_group(8, [[2], [2]]),
    ):
        store.save(g)
    store.path(9).write_bytes(b"truncated")
    said: list[str] = []
    ready, again, end = resume_groups(store, DoneIds(4), 7, 2, said.append)
    assert [g.index for g in ready] == [4, 8]
    assert again == [5, 6, 7, 9] and end == 10
    assert store.indices() == [4, 8, 9]  # the corrupt file stays until group 9's new sample replaces it
    assert sum("lost with the stopped run" in m for m in said) == 2 and any("group 9" in m for m in said)

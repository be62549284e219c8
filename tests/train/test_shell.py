"""The trainer shell driven by a stand-in objective (a step that counts): its cadences, stop_after,
the summary, and a resume that continues the count."""

import asyncio
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import CheckpointConfig
from composer_jax.train.shell import Cadence, Parts, StepLog, TrainerShell, run_to_end

STEPS, SAVE_EVERY, EVAL_EVERY, LOG_EVERY = 7, 3, 2, 2


class Counter:
    """The stand-in objective: its state is the number of steps trained; each call is recorded."""

    def __init__(self, checkpointer: TrainCheckpointer, count: int = 0, wait: bool = False):
        self.checkpointer, self.count, self.wait = checkpointer, count, wait
        self.stepped: list[int] = []
        self.evaluated: list[int] = []
        self.saved: list[tuple[int, bool]] = []
        self.calls: list[str] = []

    async def pause(self) -> None:
        if self.wait:  # a part that really waits (the RL learner's do): only an event loop runs it
            await asyncio.sleep(0)

    async def step(self, i: int) -> StepLog:
        await self.pause()
        assert i == self.count, "the shell's step counter and the state's disagree"
        self.count += 1
        self.stepped.append(i)
        return StepLog({"count": float(self.count)}, f"count {self.count}" if self.count % 2 else None)

    async def evaluate(self, n: int) -> tuple[dict[str, float], str]:
        await self.pause()
        self.evaluated.append(n)
        return {"eval/count": float(self.count)}, f"[count] step {n} evaluated {self.count}"

    def save(self, n: int, force: bool) -> None:
        self.saved.append((n, force))
        state = {"count": jnp.asarray(self.count, jnp.int32)}
        self.checkpointer.save(n, state, config={}, force=force)

    async def before_steps(self) -> None:
        self.calls.append("before")

    async def after_steps(self) -> None:
        self.calls.append("after")

    def parts(self) -> Parts:
        return Parts(self.step, self.evaluate, self.save, self.before_steps, self.after_steps)


def _checkpointer(tmp_path) -> TrainCheckpointer:
    return TrainCheckpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"), save_every=SAVE_EVERY, keep_last=0))


def _run(tmp_path, *, stop_after=None, wait=False) -> tuple[dict, Counter, list[str], list[str]]:
    checkpointer = _checkpointer(tmp_path)
    start, count = 0, 0
    if checkpointer.latest_step() is not None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)}
        restored = checkpointer.restore(abstract, config=None)
        start, count = restored.step, int(restored.train_state["count"])
    echoed: list[str] = []
    objective = Counter(checkpointer, count, wait)
    cadence = Cadence(STEPS, start, LOG_EVERY, EVAL_EVERY)
    shell = TrainerShell(
        "count", cadence, checkpointer, out_dir=tmp_path, tensorboard=False, lead=True, echo=echoed.append
    )
    assert shell.progress is not None
    shell.progress.stream, shell.progress.tty = io.StringIO(), False  # the progress bar's console lines
    loop = shell.run(objective.parts(), stop_after)
    asyncio.run(loop) if wait else run_to_end(loop)
    bars = shell.progress.stream.getvalue().splitlines()
    return shell.close(), objective, echoed, bars


def _logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_whole_run_checkpoints_evaluates_and_logs_on_its_cadence(tmp_path) -> None:
    summary, objective, echoed, bars = _run(tmp_path)
    assert objective.stepped == list(range(7)) and objective.count == 7
    # save_every=3 of 7 steps: 3 and 6 on the cadence, 7 forced at the end
    assert objective.saved == [(3, False), (6, False), (7, True)]
    assert _checkpointer(tmp_path).all_steps() == [3, 6, 7]
    # eval_every=2: step 0 of a fresh run, 2, 4 and 6 inside it, and the end (7)
    assert objective.evaluated == [0, 2, 4, 6, 7]
    assert objective.calls == ["before", "after"]
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4, 6, 7]
    assert summary["evals"][2] == {"step": 4, "eval/count": 4.0}  # the model as of step 4
    assert echoed[-1] == "[count] step 7 evaluated 7"
    assert summary["start_step"] == 0 and summary["final_step"] == 7 and "stopped_at" not in summary
    assert summary["checkpoint_dir"] == str(tmp_path / "ckpt") and summary["wall_s"] >= 0.0
    # log_every=2: steps 2, 4, 6 and the last; each evaluation logged at its step
    logged = _logged(tmp_path)
    assert [r["step"] for r in logged if "count" in r] == [2, 4, 6, 7]
    assert [r["step"] for r in logged if "eval/count" in r] == [0, 2, 4, 6, 7]
    assert all(r["stage"] == "count" for r in logged)
    # a progress line for each step that gave one (odd counts), in the same words
    assert [b.split("] ")[1].split(" |")[0] for b in bars] == [
        "1/7 count 1",
        "3/7 count 3",
        "5/7 count 5",
        "7/7 count 7",
    ]


def test_stop_after_returns_as_a_crash_would_and_a_resume_continues_the_count(tmp_path) -> None:
    first, objective, _, _ = _run(tmp_path, stop_after=4)
    assert objective.stepped == [0, 1, 2, 3] and first["stopped_at"] == 4
    assert objective.saved == [(3, False)], "a stopped run forces no checkpoint"
    assert objective.evaluated == [0, 2, 4] and objective.calls == ["before"], "nor runs the end's evaluation"

    resumed, objective, _, _ = _run(tmp_path)
    assert resumed["start_step"] == 3 and objective.stepped == [3, 4, 5, 6] and objective.count == 7
    assert objective.evaluated == [4, 6, 7], "no step-0 evaluation on a resume"
    assert objective.saved == [(6, False), (7, True)]
    assert _checkpointer(tmp_path).all_steps() == [3, 6, 7]
    logged = [r["step"] for r in _logged(tmp_path) if "count" in r]
    assert logged == [2, 4, 4, 6, 7]  # the steps after the last checkpoint are logged again, as after a crash


def test_a_resume_at_the_last_step_runs_nothing(tmp_path) -> None:
    _run(tmp_path)
    summary, objective, _, _ = _run(tmp_path)
    assert summary["start_step"] == 7 and summary["final_step"] == 7 and summary["wall_s"] == 0.0
    assert objective.stepped == [] and objective.evaluated == [] and objective.calls == ["before"]


def test_parts_that_wait_run_in_an_event_loop_and_give_the_same_run(tmp_path) -> None:
    plain, _, _, _ = _run(tmp_path / "plain")
    waiting, objective, _, _ = _run(tmp_path / "waiting", wait=True)
    assert objective.saved == [(3, False), (6, False), (7, True)]
    assert [e["step"] for e in waiting["evals"]] == [e["step"] for e in plain["evals"]]
    np.testing.assert_equal(waiting["evals"], plain["evals"])


def test_run_to_end_refuses_a_coroutine_that_waits() -> None:
    with pytest.raises(RuntimeError, match="run the shell in an event loop"):
        run_to_end(_waits())


async def _waits() -> None:
    await asyncio.sleep(0)


def test_run_to_end_runs_inside_a_running_event_loop(tmp_path) -> None:
    # a notebook's kernel has a loop running, where asyncio.run refuses to start: run_stage's driver does not
    async def notebook_cell() -> dict:
        return _run(tmp_path)[0]

    summary = asyncio.run(notebook_cell())
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4, 6, 7] and summary["final_step"] == 7

"""The trainer shell: the one loop `pretrain`, `sft` (`train/loop.py`) and `rl` (`rl/learner.py`) run.

The shell owns the bookkeeping every trainer shares and nothing of what a step is: the step
counter from the resume point to `train.steps`, the metrics log and the progress bar, the
evaluation cadence (at step 0 of a fresh run, every `eval_every` steps inside the run, at the end),
the checkpoint cadence (the checkpointer's `due`, forced at the last step), `stop_after` (return
as a crash would: no final evaluation, no forced save) and the summary's common keys. A trainer
hands it `Parts`: produce a batch and run a step, evaluate, write a checkpoint, and what it does
before the first step and after the last.

The loop is a coroutine because the RL learner's parts wait on its rollout side; a stage whose
parts never wait (pretraining, SFT) drives it with `run_to_end`, without an event loop, so that it
also runs inside a notebook's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from composer_jax.train.observe import Progress, RunLogger

T = TypeVar("T")

Evaluation = tuple[dict[str, float], str] | None  # (logged eval/... values, console line); None: nothing


class Checkpointer(Protocol):
    """What the shell asks of `checkpoint.manager.TrainCheckpointer`."""

    @property
    def config(self) -> Any: ...

    def due(self, step: int, *, force: bool = False) -> bool: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When the shell logs and evaluates. steps: the run's last step (train.steps); start: the
    step this call resumes from; eval_every: 0 evaluates at the start and the end only."""

    steps: int
    start: int
    log_every: int
    eval_every: int

    def logs(self, n: int) -> bool:
        """Whether step n's values go to the metrics log: every log_every steps and the last."""
        return n % self.log_every == 0 or n == self.steps

    def evaluates(self, n: int) -> bool:
        """An evaluation after step n inside the run (the start's and the end's are run apart)."""
        return bool(self.eval_every) and n % self.eval_every == 0 and n != self.steps


@dataclasses.dataclass(frozen=True)
class StepLog:
    """What one step hands the shell: its values (logged on the cadence's steps), the progress
    bar's text (None: the bar stays as it is) and raw arrays logged beside the values."""

    values: dict[str, float]
    line: str | None = None
    raw: Mapping[str, Any] | None = None


async def _nothing() -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Parts:
    """A trainer's side of the shell.

    step(i): produce a batch and train step i (-> step i + 1); evaluate(n): the model as of step n
    (None: nothing evaluated, e.g. on a process that does not evaluate); save(n, force): write
    checkpoint n (called only when it is due; `force` is the checkpointer's); before_steps: after
    the step-0 evaluation, before the first step; after_steps: after the last step of a run that
    reached train.steps, before the final evaluation."""

    step: Callable[[int], Awaitable[StepLog]]
    evaluate: Callable[[int], Awaitable[Evaluation]]
    save: Callable[[int, bool], None]
    before_steps: Callable[[], Awaitable[None]] = _nothing
    after_steps: Callable[[], Awaitable[None]] = _nothing


class TrainerShell:
    """The loop of one run (module docstring). `summary` holds the keys every trainer returns:
    `evals` (one {"step": n, **values} per evaluation), `start_step`, `init` (`record_init`),
    `wall_s` (the step loop's time), `stopped_at` (with `stop_after`), `final_step` and
    `checkpoint_dir` (`close`)."""

    def __init__(
        self,
        stage: str,
        cadence: Cadence,
        checkpointer: Checkpointer,
        *,
        out_dir: str | Path,
        tensorboard: bool,
        lead: bool,
        echo: Callable[[str], None],
    ):
        self.cadence, self.checkpointer, self.echo = cadence, checkpointer, echo
        self.logger = RunLogger(out_dir, stage, tensorboard, enabled=lead)
        self.progress = Progress(cadence.steps, cadence.start) if lead else None
        self.summary: dict[str, Any] = {"evals": [], "start_step": cadence.start}

    async def run(self, parts: Parts, stop_after: int | None = None) -> None:
        """Steps from the start to train.steps (or `stop_after` of them), with the evaluations and
        checkpoints."""
        c = self.cadence
        if c.start == 0:
            await self.evaluate(parts, 0)
        await parts.before_steps()
        t_run = time.perf_counter()
        for ran, step in enumerate(range(c.start, c.steps), 1):
            n = step + 1
            self.record(n, await parts.step(step))
            if c.evaluates(n):
                await self.evaluate(parts, n)
            if self.checkpointer.due(n, force=n == c.steps):
                parts.save(n, n == c.steps)
            self.summary["wall_s"] = time.perf_counter() - t_run
            if stop_after is not None and ran >= stop_after:
                self.summary["stopped_at"] = n
                return
        if c.steps > c.start:
            await parts.after_steps()
            await self.evaluate(parts, c.steps)

    async def evaluate(self, parts: Parts, n: int) -> None:
        """Evaluate as of step n: into the summary, the metrics log and the console."""
        out = await parts.evaluate(n)
        if out is None:
            return
        values, line = out
        self.summary["evals"].append({"step": n, **values})
        self.logger.log(n, values)
        self.echo(line)

    def record_init(self, n: int, init: Mapping[str, Any]) -> None:
        """Where the run's weights came from (`hf/init_from.py`'s record: kind, path, family, the
        config's sha256) as of step n: the summary's `init` and a metrics record {"init": ...}."""
        self.summary["init"] = dict(init)
        self.logger.note(n, {"init": dict(init)})

    def record(self, n: int, log: StepLog) -> None:
        """Step n's values to the metrics log (on the cadence's steps) and its progress line."""
        if self.cadence.logs(n):
            self.logger.log(n, log.values, log.raw)
        if self.progress is not None and log.line is not None:
            self.progress.update(n, log.line)

    def close(self) -> dict[str, Any]:
        """Wait for the last checkpoint, close the checkpointer and the logs; the summary."""
        if self.progress is not None:
            self.progress.close()
        self.checkpointer.wait()
        self.checkpointer.close()
        self.logger.close()
        self.summary.setdefault("wall_s", 0.0)
        self.summary["final_step"] = self.cadence.steps
        self.summary["checkpoint_dir"] = self.checkpointer.config.directory
        return self.summary


def run_to_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits (the shell over parts that only compute), run
    without an event loop: `asyncio.run` refuses to start inside a running one (a notebook's)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the trainer shell's parts waited on something: run the shell in an event loop")

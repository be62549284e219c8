"""Evaluation: the agent without training, N samples per task, and what they add up to.

Success is a reward of 1 (every test passes). Per task: pass@1 (the mean success of its samples)
and best-of-K (some sample of K succeeded), mean reward, generated tokens, turns and tool calls;
the same averaged over tasks per task category, per repository and overall. `resolved` is the
leaderboard's figure: the success of the sample each task's prediction submits (`submitted`).
Trajectories are written as JSONL (one line per sample: the OpenAI messages of every generation
and the counts). predictions.jsonl is a SWE-bench submission (`instance_id`, `model_name_or_path`,
`model_patch`): per task the grade diff of sample 0 (or of the first sample after it whose
environment did not fail), chosen without looking at any test result;
predictions.oracle.jsonl holds the best-of-K pick (the first sample that passed) and is named so
that nobody submits it. A patch must apply with `git apply`: a diff the grader cut at its budget
is left out whole (never submitted cut), and a file the diff cannot carry (a symlink, a file over
the snapshot's size limit) is left out of the patch; both are recorded in report.json
("predictions").
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_jax.rl.rollout.agent import Rollout, RolloutFailed
from composer_jax.rl.rollout.tasks import TaskRef

SUCCESS = 1.0 - 1e-9
# env/sandbox/snapshot.py's TRUNCATED: the line a grade diff cut at its byte budget ends with (no line of a
# patch looks like it: patch lines start with ' ', '+', '-', '@', '\\' or a git header word)
DIFF_TRUNCATED = "... diff truncated ...\n"
UNGROUPED_REPO, UNGROUPED_CATEGORY = "bundled", "-"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def submitted(rollouts: Sequence[Rollout | RolloutFailed]) -> int | None:
    """The index of the sample a task's prediction submits: sample 0, or the first after it whose
    environment did not fail (an infrastructure failure, not the model's); the tests' results are
    never looked at. None when the environment failed on every sample."""
    return next((i for i, r in enumerate(rollouts) if isinstance(r, Rollout)), None)


def task_metrics(rollouts: Sequence[Rollout | RolloutFailed]) -> dict[str, float]:
    done = [r for r in rollouts if isinstance(r, Rollout)]
    success = [float(r.env_reward >= SUCCESS) for r in done]
    pick = submitted(rollouts)
    chosen = rollouts[pick] if pick is not None else None
    return {
        "samples": float(len(rollouts)),
        "env_failures": float(len(rollouts) - len(done)),
        "resolved": float(isinstance(chosen, Rollout) and chosen.env_reward >= SUCCESS),
        "pass@1": _mean(success),
        "best_of_k": float(any(success)),
        "reward": _mean([r.env_reward for r in done]),
        "tokens": _mean([float(r.generated_tokens) for r in done]),
        "turns": _mean([float(r.turns) for r in done]),
        "tool_calls": _mean([float(r.tool_calls) for r in done]),
        "broken_tool_calls": _mean([float(r.broken_tool_calls) for r in done]),
    }


def report(results: dict[TaskRef, list[Rollout | RolloutFailed]]) -> dict[str, Any]:
    """{"tasks": {name: metrics}, "categories": {category: metrics averaged over its tasks},
    "repositories": {repo: the same}, "overall": metrics averaged over tasks}. Tasks without a
    [metadata] category or repo (the bundled suite) group under "-" and "bundled"."""
    per_task = {t.name: task_metrics(rs) for t, rs in results.items()}
    by_cat: dict[str, list[dict[str, float]]] = defaultdict(list)
    by_repo: dict[str, list[dict[str, float]]] = defaultdict(list)
    for t in results:
        by_cat[t.category or UNGROUPED_CATEGORY].append(per_task[t.name])
        by_repo[t.repo or UNGROUPED_REPO].append(per_task[t.name])

    def average(ms: list[dict[str, float]]) -> dict[str, float]:
        keys = ms[0].keys() if ms else ()
        avg = {k: _mean([m[k] for m in ms]) for k in keys if k not in ("samples", "env_failures")}
        avg.update(tasks=float(len(ms)), env_failures=sum(m["env_failures"] for m in ms))
        return avg

    return {
        "tasks": per_task,
        "categories": {c: average(ms) for c, ms in sorted(by_cat.items())},
        "repositories": {r: average(ms) for r, ms in sorted(by_repo.items())},
        "overall": average(list(per_task.values())),
    }


def format_table(rep: dict[str, Any]) -> str:
    """report()'s groups as a fixed-width table: resolved (sample 0), pass@1, best-of-K, tasks."""
    rows = [("", "group", "resolved", "pass@1", "best_of_k", "tasks")]
    for section, key in (("repositories", "repository"), ("categories", "category")):
        for name, m in rep.get(section, {}).items():
            rows.append(
                (key, name, f"{m['resolved']:.3f}", f"{m['pass@1']:.3f}", f"{m['best_of_k']:.3f}", f"{m['tasks']:.0f}")
            )
    o = rep["overall"]
    rows.append(
        ("overall", "", f"{o['resolved']:.3f}", f"{o['pass@1']:.3f}", f"{o['best_of_k']:.3f}", f"{o['tasks']:.0f}")
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def submittable_patch(diff: str, max_bytes: int | None = None) -> tuple[str, dict[str, Any]]:
    """(model_patch, note) from a grade diff: "" with note {"left_out": "over the size limit"} when
    the grader cut it (DIFF_TRUNCATED) or it is over `max_bytes`, never a cut patch; otherwise the
    diff without the sections `git apply` cannot apply ("Binary files a/X and b/X differ": a
    symlink or an unread large file), their paths in note["files_left_out"]."""
    size = len(diff.encode("utf-8"))
    if diff.endswith(DIFF_TRUNCATED) or (max_bytes is not None and size > max_bytes):
        return "", {"left_out": "over the size limit", "bytes": size}
    sections = re.split(r"(?m)^(?=diff --git )", diff)
    kept, dropped = [], []
    for sec in sections:
        head = re.search(r"(?m)^Binary files a/(.+) and b/.+ differ$", sec)
        if head and "GIT binary patch" not in sec:
            dropped.append(head.group(1))
        else:
            kept.append(sec)
    patch = "".join(kept)
    note: dict[str, Any] = {"bytes": len(patch.encode("utf-8"))}
    if dropped:
        note["files_left_out"] = dropped
    return patch, note


Outcomes = dict[str, list[float | None]]  # task name -> success (1.0 / 0.0) per sample; None: the environment failed


def outcomes(results: dict[TaskRef, list[Rollout | RolloutFailed]]) -> Outcomes:
    """Each rollout's success by (task name, sample index), the unit a paired comparison matches on:
    two evaluations with the same `seed`, tasks and samples run every pair on the same sampling seed."""
    return {
        t.name: [float(r.env_reward >= SUCCESS) if isinstance(r, Rollout) else None for r in rs]
        for t, rs in results.items()
    }


def paired_difference(start: Outcomes, end: Outcomes) -> dict[str, float]:
    """The change in pass@1 from `start` to `end` measured per rollout: over the (task, sample) pairs
    present and scored in both, each task's mean of end-minus-start success d_t; the difference is
    the mean of the d_t over the n tasks (the mean over pairs when every task has as many), its
    standard error std(d_t, ddof=1) / sqrt(n) (the samples of one task share its prompt and are
    correlated: the task, e.g. a generated family's seed, is the independent unit), z = diff / se.
    Keys: diff, se, z (left out when se is 0), tasks (n), pairs. Fewer than two tasks: diff only."""
    per_task: list[float] = []
    pairs = 0
    for name, a in start.items():
        b = end.get(name)
        if b is None:
            continue
        ds = [y - x for x, y in zip(a, b) if x is not None and y is not None]
        if ds:
            per_task.append(sum(ds) / len(ds))
            pairs += len(ds)
    n = len(per_task)
    out: dict[str, float] = {"tasks": float(n), "pairs": float(pairs)}
    if n == 0:
        return out
    diff = sum(per_task) / n
    out["diff"] = diff
    if n >= 2:
        se = math.sqrt(sum((d - diff) ** 2 for d in per_task) / (n - 1) / n)
        out["se"] = se
        if se > 0:
            out["z"] = diff / se
    return out


def format_paired(paired: dict[str, float]) -> str:
    """A paired_difference as one phrase: "+0.070 (se 0.031, z 2.26; 64 tasks, 128 pairs)"."""
    if "diff" not in paired:
        return "n/a (no task scored in both)"
    stats = [f"se {paired['se']:.3f}"] if "se" in paired else []
    stats += [f"z {paired['z']:.2f}"] if "z" in paired else []
    counts = f"{paired['tasks']:.0f} tasks, {paired['pairs']:.0f} pairs"
    return f"{paired['diff']:+.3f} ({', '.join(stats)}; {counts})" if stats else f"{paired['diff']:+.3f} ({counts})"


def write_outputs(
    results: dict[TaskRef, list[Rollout | RolloutFailed]], out_dir: str | Path, model_name: str
) -> dict[str, Path]:
    """trajectories.jsonl, predictions.jsonl (SWE-bench submission: sample 0), predictions.oracle.jsonl
    (best-of-K, not a submission) and report.json (with "predictions": what each patch is and what
    was left out of it) under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = {
        "trajectories": "trajectories.jsonl",
        "predictions": "predictions.jsonl",
        "oracle": "predictions.oracle.jsonl",
        "report": "report.json",
    }
    paths = {k: out / v for k, v in names.items()}
    with paths["trajectories"].open("w") as f:
        for task, rs in results.items():
            for i, r in enumerate(rs):
                rec: dict[str, Any] = {"instance_id": task.name, "sample": i}
                rec.update(r.trajectory() if isinstance(r, Rollout) else {"task_id": task.task_id, "error": str(r)})
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    rep = report(results)
    notes: dict[str, dict[str, Any]] = {}
    with paths["predictions"].open("w") as f, paths["oracle"].open("w") as g:
        for task, rs in results.items():
            index = submitted(rs)
            first = rs[index] if index is not None else None
            oracle = next((r for r in rs if isinstance(r, Rollout) and r.env_reward >= SUCCESS), first)
            for out_file, pick in ((f, first), (g, oracle)):
                patch, note = (
                    submittable_patch(pick.grade.get("diff", ""))
                    if isinstance(pick, Rollout)
                    else ("", {"left_out": "the environment failed on every sample"})
                )
                record = {"instance_id": task.submission_id, "model_name_or_path": model_name, "model_patch": patch}
                out_file.write(json.dumps(record) + "\n")
                if out_file is f:
                    notes[task.submission_id] = {"task": task.name, "sample": index, **note}
    rep["predictions"] = {
        "file": paths["predictions"].name,
        "selection": "sample 0 of each task, or the first after it whose environment did not fail "
        "(never by test results)",
        "oracle_file": paths["oracle"].name,
        "oracle_selection": "the first sample that passed, else sample 0 (uses the grades: not a submission)",
        "instances": notes,
    }
    paths["report"].write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
    return paths


def held_out_tasks(names: Sequence[str], seeds: int, first_seed: int) -> list[TaskRef]:
    """The held-out tasks of a run: each task id once, each `gen/FAMILY` at `seeds` seeds from
    `first_seed` on (`rl.eval_tasks`, `rl.eval_seeds`, `rl.eval_seed`)."""
    return [
        TaskRef(name, first_seed + i if name.startswith("gen/") else None)
        for name in names
        for i in range(seeds if name.startswith("gen/") else 1)
    ]


class HeldOutEvaluation:
    """A run's held-out evaluations: the same tasks and rollout seeds every time (when: the trainer
    shell's cadence, `train/shell.py`); each one's per-rollout outcomes kept on disk under
    `outcome_dir/step_NNNNNN.json` (a resumed run pairs with the step-0 evaluation it did not run),
    and a later one compared with step 0 pair by pair (`paired_difference`).

    `sample(tasks, samples, seed)` draws the rollouts (the learner's rollout side: its policy pool
    and environment client)."""

    SEED = 10_000_019  # rollout seeds of every evaluation: rollout_seed(SEED + rl.eval_seed, j)

    def __init__(
        self,
        tasks: Sequence[TaskRef],
        *,
        samples: int,
        seed: int,
        outcome_dir: str | Path,
    ):
        self.tasks, self.samples, self.seed = list(tasks), samples, self.SEED + seed
        self.outcome_dir = Path(outcome_dir)

    async def run(self, step: int, sample: Any) -> tuple[dict[str, float], str] | None:
        """Evaluate the policy as of `step`: its logged values (eval/...) and a console line; None
        when the run has no held-out tasks."""
        if not self.tasks:
            return None
        res = await sample(self.tasks, self.samples, self.seed)
        overall = report(res)["overall"]
        values = {f"eval/{k}": v for k, v in overall.items()}
        outs = outcomes(res)
        self.outcome_dir.mkdir(parents=True, exist_ok=True)
        (self.outcome_dir / f"step_{step:06d}.json").write_text(json.dumps(outs) + "\n")
        start_file = self.outcome_dir / f"step_{0:06d}.json"
        line = f"[rl] step {step} held-out pass@1 {overall['pass@1']:.3f} reward {overall['reward']:.3f}"
        if step > 0 and start_file.exists():
            paired = paired_difference(json.loads(start_file.read_text()), outs)
            values.update({f"eval/paired_{k}": v for k, v in paired.items()})
            line += f"; paired change from step 0 {format_paired(paired)}"
        return values, line

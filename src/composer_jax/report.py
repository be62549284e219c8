"""`composer-jax report RUN_DIR`: a run directory's Markdown report with PNG plots.

A run directory holds one folder per stage, each with the `metrics.jsonl` its RunLogger wrote (one
JSON record per logged step: `{"stage", "step", "time", name: value, ...}`; a step's evaluation is
a separate record at the same step) and, for evaluations, a `report.json` written by
`rl.evaluate.write_outputs`. This module reads them all and writes, under RUN_DIR:

- `report.md`: per stage, first -> last of the main values and their trends (`trend`: least-squares
  slope with its standard error, first- and last-quarter means with theirs), the RL table per step (with the
  held-out pass@1 and its paired change from step 0: diff, standard error, z), the RL stage's "Where
  the time goes" table (one row per step and per evaluation, from the learner's `profile/...` and
  `eval/profile/...` values: runtime/profile.py) under the per-step means (`time_line`), and every
  evaluation's overall and per-category table;
- `plots/pretraining.png`: train loss and held-out perplexity over steps, one row per stage, and
  for a stage trained on a mixture each source's train nll (`source_nll/NAME`, with a table);
  each figure is a grid (`grid`: at most GRID_COLUMNS panels a row, a stage's panels wrapping);
- `plots/rl.png`: reward (total and grade), success and best-of-K, length penalty, staleness
  (version lag, dropped stale groups), sampler/trainer mismatch KL and held-out pass@1 over RL
  steps, for every stage whose records carry RL values.

Nothing here imports JAX: a report can be made on any machine from a copied run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_jax.errors import UsageError

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] in step order

# (panel title, [(metric, label)]) of the RL figure; panels with no data are left out
RL_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("reward/total", "total"), ("reward/grade", "grade"), ("eval/reward", "held-out"))),
    (
        "success",
        (("rollout/success", "mean"), ("rollout/best_of_k", "best-of-K"), ("eval/pass@1", "held-out pass@1")),
    ),
    ("length penalty", (("reward/length_penalty", "length penalty"),)),
    ("staleness (versions)", (("version_lag_mean", "mean lag"), ("version_lag_max", "max lag"))),
    ("dropped stale groups", (("rl/dropped_stale_groups", "dropped"),)),
    ("sampler/trainer mismatch KL", (("mismatch_kl_k1", "k1"), ("mismatch_kl_k3", "k3"))),
)
PRETRAIN_PANELS: tuple[tuple[str, str], ...] = (("loss", "train loss"), ("eval/perplexity", "held-out perplexity"))
SOURCE_PREFIX = "source_nll/"  # a mixture's per-source train nll (train/loop.py), one series per source


class ReportError(ValueError):
    """A run directory that cannot be reported on (missing, or with unreadable records)."""


@dataclass
class Stage:
    name: str
    path: Path  # the metrics.jsonl
    series: Series = field(default_factory=dict)
    init: dict[str, Any] | None = None  # where its weights came from: the first {"init": ...} record

    @property
    def is_rl(self) -> bool:
        return "reward/total" in self.series


@dataclass
class Evaluation:
    name: str
    path: Path
    report: dict[str, Any]


def read_metrics(path: Path) -> Series:
    """metric -> [(step, value)] sorted by step (a resumed run's repeated step keeps the last value)."""
    by_key: dict[str, dict[int, float]] = defaultdict(dict)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise ReportError(f"{path}:{n}: not a metrics record (a JSON object with a 'step'): {e}") from e
        for k, v in rec.items():
            if k in ("stage", "step", "time") or isinstance(v, bool) or not isinstance(v, int | float):
                continue  # raw arrays (expert counts) and tags are not plotted
            by_key[k][step] = float(v)
    return {k: sorted(d.items()) for k, d in by_key.items()}


def read_init(path: Path) -> dict[str, Any] | None:
    """The stage's `init` record (train/shell.py `record_init`: kind hf/orbax/run/scratch/resume,
    path, family, config_sha256): the first one, where the run's weights came from (a resumed run
    appends a `resume` record after it)."""
    for line in path.read_text().splitlines():
        if '"init"' in line:
            rec = json.loads(line)
            if isinstance(rec.get("init"), dict):
                return rec["init"]
    return None


def init_line(init: dict[str, Any] | None) -> str:
    """The report's "weights from" phrase of an `init` record."""
    if not init:
        return "not recorded"
    if init.get("kind") == "scratch":
        return f"fresh initialisation (seed {init.get('seed')})"
    notes = [str(init["family"])] if init.get("family") else []
    if init.get("config_sha256"):
        notes.append(f"config sha256 `{str(init['config_sha256'])[:12]}`")
    extra = f" ({', '.join(notes)})" if notes else ""
    return f"{init.get('kind')} checkpoint `{init.get('path')}`{extra}"


def collect(run_dir: Path) -> tuple[list[Stage], list[Evaluation]]:
    if not run_dir.is_dir():
        raise ReportError(f"run directory {str(run_dir)!r} does not exist or is not a directory")
    name = lambda p: str(p.parent.relative_to(run_dir)) if p.parent != run_dir else run_dir.name
    stages = [
        Stage(name(p), p, read_metrics(p), read_init(p))
        for p in sorted(run_dir.rglob("metrics.jsonl"), key=lambda p: (p.stat().st_mtime, str(p)))
    ]
    evals = []
    for p in sorted(run_dir.rglob("report.json")):
        try:
            rep = json.loads(p.read_text())
        except ValueError as e:
            raise ReportError(f"{p}: not JSON: {e}") from e
        if isinstance(rep, dict) and isinstance(rep.get("overall"), dict):
            evals.append(Evaluation(str(p.parent.relative_to(run_dir)), p, rep))
    if not stages and not evals:
        raise ReportError(
            f"run directory {str(run_dir)!r} holds no metrics.jsonl and no evaluation report.json; give the "
            "directory a run wrote (train.out_dir, or the folder above its stages)"
        )
    return stages, evals


@dataclass(frozen=True)
class Trend:
    """A noisy curve's direction with its uncertainty, instead of its first and last point.

    slope: the least-squares change per step; slope_se its standard error (residual variance over
    n - 2 degrees of freedom; nan below 3 points). head / tail: the mean of the first and the last
    quarter of the points (`quarter` points each, at least one) with standard errors of the mean
    (sample standard deviation / sqrt(quarter); nan for a single point)."""

    n: int
    slope: float
    slope_se: float
    quarter: int
    head_mean: float
    head_se: float
    tail_mean: float
    tail_se: float

    @property
    def z(self) -> float:
        """slope / its standard error (nan when that is not defined or zero)."""
        return self.slope / self.slope_se if self.slope_se > 0 else math.nan


def _mean_se(ys: Sequence[float]) -> tuple[float, float]:
    m = sum(ys) / len(ys)
    if len(ys) < 2:
        return m, math.nan
    return m, math.sqrt(sum((y - m) ** 2 for y in ys) / (len(ys) - 1) / len(ys))


def trend(points: Sequence[tuple[float, float]]) -> Trend:
    """The `Trend` of [(step, value), ...] (in step order; at least 2 distinct steps)."""
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        raise ValueError(f"a trend needs at least 2 distinct steps, got {list(points)!r}")
    n = len(points)
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    ssr = sum((y - (my + slope * (x - mx))) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(ssr / (n - 2) / sxx) if n > 2 else math.nan
    q = max(1, n // 4)
    head, tail = _mean_se(ys[:q]), _mean_se(ys[-q:])
    return Trend(n, slope, se, q, head[0], head[1], tail[0], tail[1])


def _with_se(v: float, se: float, digits: int, sign: str = "") -> str:
    """`v` to `digits` decimals, then '+- se' when its standard error is defined (not for one point)."""
    text = f"{v:{sign}.{digits}f}"
    return f"{text} +- {se:.{digits}f}" if math.isfinite(se) else text


def format_trend(t: Trend, digits: int = 3) -> str:
    """e.g. 'slope -0.004 +- 0.006 /step (z -0.7, 10 steps); first quarter 0.21 +- 0.02 -> last 0.18 +- 0.03'.

    A value without a standard error (a quarter of one point, a slope through two) prints alone."""
    z = f"z {t.z:.1f}, " if math.isfinite(t.z) else ""
    return (
        f"slope {_with_se(t.slope, t.slope_se, digits, '+')} /step ({z}{t.n} steps); first quarter "
        f"{_with_se(t.head_mean, t.head_se, digits)} -> last {_with_se(t.tail_mean, t.tail_se, digits)} "
        f"({t.quarter} each)"
    )


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def _first_last(s: list[tuple[int, float]]) -> str:
    return f"{_fmt(s[0][1])} -> {_fmt(s[-1][1])} (steps {s[0][0]}-{s[-1][0]})"


GRID_COLUMNS = 3  # panels per figure row: a stage's panels wrap onto as many rows as they need


def grid(panel_counts: Sequence[int], max_cols: int = GRID_COLUMNS) -> tuple[int, int, list[int]]:
    """The figure grid for stages with these panel counts: (rows, cols, each stage's first row).

    Columns are the widest stage's panel count up to `max_cols`; each stage starts on a row of its
    own and wraps its panels onto ceil(count / cols) rows, so six panels read as 2 x 3, not 1 x 6."""
    cols = min(max_cols, max(panel_counts))
    firsts, row = [], 0
    for n in panel_counts:
        firsts.append(row)
        row += -(-n // cols)
    return row, cols, firsts


def _plot(panels: Sequence[tuple[str, Sequence[tuple[str, str]]]], stages: list[Stage], out: Path, title: str) -> bool:
    """Each stage's panels with data on rows of `grid`'s columns; False when nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(st, [(t, [(k, lab) for k, lab in ms if k in st.series]) for t, ms in panels]) for st in stages]
    rows = [(st, [(t, ms) for t, ms in ps if ms]) for st, ps in rows]
    rows = [(st, ps) for st, ps in rows if ps]
    if not rows:
        return False
    n_rows, cols, firsts = grid([len(ps) for _, ps in rows])
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.0 * n_rows), squeeze=False)
    used = set()
    for (st, ps), first in zip(rows, firsts, strict=True):
        for i, (t, ms) in enumerate(ps):
            r, c = first + i // cols, i % cols
            used.add((r, c))
            _draw_panel(axes[r][c], st, t, ms)
    for r in range(n_rows):
        for c in range(cols):
            if (r, c) not in used:
                axes[r][c].axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def _draw_panel(ax: Any, st: Stage, title: str, metrics: Sequence[tuple[str, str]]) -> None:
    """One panel: each metric of `st` over its steps, titled with the stage."""
    for k, lab in metrics:
        xs, ys = zip(*st.series[k], strict=True)
        ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, markersize=3, label=lab)
    ax.set_title(f"{st.name}: {title}", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if len(metrics) > 1:
        ax.legend(fontsize=7)


RL_TABLE = (
    ("reward/total", "reward"),
    ("rollout/success", "success"),
    ("rollout/best_of_k", "best-of-K"),
    ("reward/length_penalty", "length pen."),
    ("version_lag_mean", "lag mean"),
    ("version_lag_max", "lag max"),
    ("mismatch_kl_k1", "mismatch KL"),
    ("eval/pass@1", "held-out pass@1"),
    ("eval/paired_diff", "paired change"),
    ("eval/paired_se", "paired se"),
    ("eval/paired_z", "z"),
)
EVAL_COLUMNS = ("pass@1", "best_of_k", "reward", "tokens", "turns", "tool_calls")


def _rl_table(st: Stage) -> list[str]:
    cols = [(k, lab) for k, lab in RL_TABLE if k in st.series]
    steps = sorted({s for k, _ in cols for s, _ in st.series[k]})
    values = {k: dict(st.series[k]) for k, _ in cols}
    lines = ["| step | " + " | ".join(lab for _, lab in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for s in steps:
        cells = [_fmt(values[k][s]) if s in values[k] else "" for k, _ in cols]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


# "Where the time goes" (runtime/profile.py): (key of a step's record, label); an evaluation's record has
# the profile keys under eval/ (the trainer's own keys are a step's only)
TIME_COLUMNS = (
    ("profile/wall_s", "wall s"),
    ("time/wait_s", "trainer waits s"),
    ("time/update_s", "update s"),
    ("profile/sampler_prefill_s", "prefill s"),
    ("profile/sampler_compile_s", "of which compiling s"),
    ("profile/sampler_decode_s", "decode s"),
    ("profile/sampler_tokenize_s", "tokenise s"),
    ("profile/sampler_http_s", "HTTP s"),
    ("profile/sampler_http_cpu_s", "HTTP thread CPU s"),
    ("profile/env_tool_s", "tool calls s"),
    ("profile/env_grade_s", "grading s"),
    ("profile/trainer_cpu_s", "trainer CPU s"),
)
_CORE_KEY = re.compile(r"profile/core(\d+)_busy")
TIME_NOTE = (
    "Each row is an interval: a step's from the previous step's or evaluation's end to its end (the rollouts "
    "sampled meanwhile, the update, the checkpoint after the previous step), an evaluation's from its start to "
    "its end. Prefill (of which compiling: admissions that compiled a program) and decode are the sampler "
    "engine's seconds (one engine thread per replica, summed over replicas; token sampling is inside the "
    "compiled prefill and decode programs, not a part of its own); "
    "tokenise and HTTP the serve replicas' request handlers' seconds (JSON decoding and encoding), HTTP "
    "thread CPU their event loops' CPU seconds; tool calls and grading the environment servers' seconds summed "
    "over concurrent calls (they can exceed the wall time); trainer CPU the learner process's CPU seconds, all "
    "threads; core i the share of the interval core i was busy, whatever ran on it."
)


def _time_cell(key: str, v: float) -> str:
    return f"{100 * v:.0f}%" if _CORE_KEY.fullmatch(key) else f"{v:.3g}"


def time_columns(keys: set[str] | Mapping[str, Any]) -> list[tuple[str, str]]:
    """The "Where the time goes" columns (step key, label) that records with `keys` have: TIME_COLUMNS,
    then one busy column per core."""
    present = {k.removeprefix("eval/") for k in keys}
    cores = sorted({int(m.group(1)) for k in present if (m := _CORE_KEY.fullmatch(k))})
    cols = [(k, lab) for k, lab in TIME_COLUMNS if k in present]
    return cols + [(f"profile/core{c}_busy", f"core {c} busy") for c in cores]


def _time_table(st: Stage) -> list[str]:
    """One row per step and per evaluation (after the step it follows) with profile values."""
    cols = time_columns(set(st.series))
    if not any(k == "profile/wall_s" for k, _ in cols):
        return []
    rows = [(n, 1, "eval/") for n, _ in st.series.get("eval/profile/wall_s", [])]
    rows += [(n, 0, "") for n, _ in st.series.get("profile/wall_s", [])]
    values = {k: dict(v) for k, v in st.series.items()}
    lines = ["| | " + " | ".join(lab for _, lab in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for n, _, pre in sorted(rows):
        cells = [_time_cell(k, values[pre + k][n]) if n in values.get(pre + k, {}) else "" for k, _ in cols]
        lines.append(f"| {'evaluation at' if pre else 'step'} {n} | " + " | ".join(cells) + " |")
    steps = [{k: values[k][n] for k in values if n in values[k]} for n, _ in st.series.get("profile/wall_s", [])]
    means = time_line(steps)
    return ["#### Where the time goes", "", *([means, ""] if means else []), *lines, "", TIME_NOTE, ""]


def where_the_time_goes(metrics: str | Path) -> str:
    """The "Where the time goes" section (per-step means, table, note) of one stage's metrics.jsonl
    ('' without profile values): what bench/demo_profile.py prints."""
    path = Path(metrics)
    return "\n".join(_time_table(Stage(path.parent.name, path, read_metrics(path))))


def time_line(steps: Sequence[Mapping[str, float]]) -> str:
    """The per-step means of the profile values of `steps` (each a step's values) in one line: the
    demo's summary and the report's line above its table; '' without profile values."""
    steps = [s for s in steps if "profile/wall_s" in s]
    if not steps:
        return ""

    def mean(key: str) -> float | None:
        xs = [s[key] for s in steps if key in s]
        return sum(xs) / len(xs) if xs else None

    def part(label: str, key: str) -> str:
        m = mean(key)
        return "" if m is None else f"{label} {m:.3g} s"

    def join(parts: Sequence[str]) -> str:
        return ", ".join(p for p in parts if p)

    trainer = join([part("trainer waits", "time/wait_s"), part("update", "time/update_s")])
    sampler = join(
        [
            part("prefill", "profile/sampler_prefill_s"),
            part("decode", "profile/sampler_decode_s"),
            part("tokenise", "profile/sampler_tokenize_s"),
            part("HTTP", "profile/sampler_http_s"),
        ]
    )
    env = join([part("tool calls", "profile/env_tool_s"), part("grading", "profile/env_grade_s")])
    cores = [(k, mean(k)) for k, _ in time_columns(set().union(*steps)) if _CORE_KEY.fullmatch(k)]
    busy = ", ".join(
        f"{k.removeprefix('profile/core').removesuffix('_busy')} {100 * (m or 0.0):.0f}%" for k, m in cores
    )
    out = f"where the time goes, mean of {len(steps)} step(s): wall {mean('profile/wall_s'):.3g} s"
    out += f" ({trainer})" if trainer else ""
    out += f"; sampler {sampler}" if sampler else ""
    out += f"; environment {env} (summed over concurrent calls)" if env else ""
    return out + (f"; cores busy {busy}" if busy else "")


def _heldout_line(st: Stage) -> list[str]:
    """The held-out evaluations first -> last, with the last one's paired change from step 0 (the
    same rollout seeds at both: rl/evaluate.py::paired_difference)."""
    p = st.series.get("eval/pass@1")
    if not p or len(p) < 2:
        return []
    line = f"Held-out pass@1 {_fmt(p[0][1])} (step {p[0][0]}) -> {_fmt(p[-1][1])} (step {p[-1][0]})"
    last = {
        k: dict(st.series.get(k, [])).get(p[-1][0]) for k in ("eval/paired_diff", "eval/paired_se", "eval/paired_z")
    }
    if last["eval/paired_diff"] is not None:
        line += f"; paired change {last['eval/paired_diff']:+.4g}"
        if last["eval/paired_se"] is not None:
            line += f" (standard error {_fmt(last['eval/paired_se'])} over the held-out tasks"
            line += f", z {_fmt(last['eval/paired_z'])})" if last["eval/paired_z"] is not None else ")"
    return [line + ".", ""]


TREND_NOTE = (
    "Trends: the least-squares slope over the logged steps with its standard error, and the means of the first "
    "and last quarter of the points with theirs (`report.trend`): a first -> last pair of a noisy curve can fall "
    "while the curve rises."
)
TREND_METRICS = (("reward/total", "reward"), ("rollout/success", "success"), ("eval/pass@1", "held-out pass@1"))


def _trend_cell(points: list[tuple[int, float]]) -> str:
    """The trend of a curve of 3 points or more (with 2 its slope has no standard error), else ''."""
    return format_trend(trend(points), 4) if len({x for x, _ in points}) >= 3 else ""


def _trend_lines(st: Stage) -> list[str]:
    """Per RL curve: its trend over the steps (TREND_NOTE)."""
    out = [
        f"- {lab}: {format_trend(trend(st.series[k]))}" for k, lab in TREND_METRICS if _trend_cell(st.series.get(k, []))
    ]
    return [*out, "", TREND_NOTE, ""] if out else []


def _eval_table(ev: Evaluation) -> list[str]:
    rows = [("overall", ev.report["overall"])] + sorted((ev.report.get("categories") or {}).items())
    cols = [c for c in EVAL_COLUMNS if any(c in m for _, m in rows)]
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in rows:
        lines.append(f"| {name} | " + " | ".join(_fmt(float(m[c])) if c in m else "" for c in cols) + " |")
    return lines


def _source_keys(stages: list[Stage]) -> list[str]:
    return sorted({k for s in stages for k in s.series if k.startswith(SOURCE_PREFIX)})


def _pretrain_panels(stages: list[Stage]) -> list[tuple[str, list[tuple[str, str]]]]:
    """PRETRAIN_PANELS one metric each, and with a mixture the train nll of every source in one."""
    panels = [(lab, [(k, lab)]) for k, lab in PRETRAIN_PANELS]
    sources = _source_keys(stages)
    if sources:
        panels.append(("train nll by source", [(k, k[len(SOURCE_PREFIX) :]) for k in sources]))
    return panels


def _source_table(stages: list[Stage]) -> list[str]:
    """Per stage trained on a mixture, each source's train nll first -> last and its trend (the
    steps a source had target tokens in): which source a spike of the train loss comes from."""
    rows = [(s, k) for s in stages for k in _source_keys([s])]
    if not rows:
        return []
    lines = ["| stage | source | train nll | trend |", "|---|---|---|---|"]
    for s, k in rows:
        lines.append(
            f"| {s.name} | {k[len(SOURCE_PREFIX) :]} | {_first_last(s.series[k])} | {_trend_cell(s.series[k])} |"
        )
    return [*lines, ""]


def _init_lines(stages: list[Stage]) -> list[str]:
    if not any(s.init for s in stages):
        return []
    return ["| stage | weights from |", "|---|---|", *(f"| {s.name} | {init_line(s.init)} |" for s in stages), ""]


def _machine_lines(run: Path) -> list[str]:
    """The machine the run was timed on (`machine.json`, which the demo writes: machine.py)."""
    try:
        m = json.loads((run / "machine.json").read_text())
        cpu, cores, gflops = str(m["cpu"]), int(m["cores"]), float(m["calibration_gflops"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    wall = f"wall time {int(m['wall_s'] // 60)}m{int(m['wall_s'] % 60):02d}s on " if "wall_s" in m else ""
    return [f"Machine: {wall}{cpu}, {cores} core{'' if cores == 1 else 's'}, {gflops:.1f} GFLOP/s float32 matmul.", ""]


def write_report(run_dir: str | Path, title: str | None = None) -> Path:
    """Write RUN_DIR/report.md and RUN_DIR/plots/*.png; returns the Markdown path."""
    run = Path(run_dir)
    stages, evals = collect(run)
    plots = run / "plots"
    pre = [s for s in stages if not s.is_rl]
    rl = [s for s in stages if s.is_rl]
    lines = [f"# {title or 'Run report'}: `{run.name}`", "", *_machine_lines(run)]
    if pre and _plot(_pretrain_panels(pre), pre, plots / "pretraining.png", "pretraining"):
        lines += ["## Pretraining stages", "", "![pretraining](plots/pretraining.png)", ""]
        lines += ["| stage | train loss | held-out perplexity | train loss trend |", "|---|---|---|---|"]
        for s in pre:
            cells = [_first_last(s.series[k]) if k in s.series else "" for k, _ in PRETRAIN_PANELS]
            cells.append(_trend_cell(s.series.get("loss", [])))
            lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
        lines += ["", TREND_NOTE, "", *_init_lines(pre), *_source_table(pre)]
    if rl and _plot(RL_PANELS, rl, plots / "rl.png", "reinforcement learning"):
        lines += ["## Reinforcement learning", "", "![rl](plots/rl.png)", ""]
        for s in rl:
            lines += [f"### {s.name}", "", f"Weights from: {init_line(s.init)}.", ""]
            lines += [*_heldout_line(s), *_trend_lines(s), *_rl_table(s), "", *_time_table(s)]
    for ev in evals:
        lines += [f"## Evaluation: {ev.name}", "", *_eval_table(ev), ""]
    out = run / "report.md"
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="composer-jax report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run directory (holding stage folders with metrics.jsonl)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    try:
        out = write_report(args.run_dir, args.title)
    except ReportError as e:
        raise UsageError(str(e)) from e
    print(f"wrote {out}")
    return 0

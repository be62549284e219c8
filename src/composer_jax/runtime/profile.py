"""Where an RL run's time goes: per step and per evaluation, the wall time split into the parts each
service already counts, and each core's busy fraction.

At every step's end and at each evaluation's start and end the learner takes a `Snapshot`:

* each core's busy and total jiffies from `/proc/stat`, for the cores the learner may use when it
  starts (before `rl.pin_cores` pins the trainer to one of them: its replicas', environment
  servers' and sandboxes' cores are in that set too). Busy is everything but idle and iowait, of
  whatever ran there: on a shared machine other jobs count too;
* the learner process's CPU seconds (every thread: the train step's XLA threads, the rollout side's
  event loop, the HTTP clients);
* the counters of every service the rollout side talks to (`Rollouts.profile_counters`): a serve
  replica's /metrics (inference/server/metrics.py: engine step seconds, the admissions' (prefill)
  seconds among them, tokenising seconds, HTTP (JSON) seconds, its event loop thread's CPU
  seconds), an environment server's /metrics (env/server/metrics.py: tool-call seconds by tool,
  grading seconds, session-creation seconds), the in-process sampler's driver totals. Each
  exposition is read with prometheus_client's own parser (`counters_of`).

`Profile.mark` returns the differences since the previous snapshot as `profile/...` values (the
learner prefixes an evaluation's with `eval/`); `KEYS` says what each one is. A counter that went
down (a replica restarted) counts from zero. What is not split: token sampling runs inside the
compiled prefill and decode programs (one XLA program each), so it is part of their seconds, not
a column of its own; the vLLM engine's counters are not read (its replicas give no `profile/sampler_*`).

The cost: one /proc/stat read and one GET /metrics per service per step and evaluation (about a
millisecond each), so the profile is always on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "KEYS",
    "PREFIX",
    "Profile",
    "Snapshot",
    "busy_fractions",
    "core_jiffies",
    "counter_deltas",
    "counters_of",
]

PREFIX = "profile/"
PROC_STAT = Path("/proc/stat")
# /proc/stat's cpuN fields: user nice system idle iowait irq softirq steal (guest and guest_nice
# are already counted in user and nice); idle and iowait are the not-busy ones
_IDLE_FIELDS = (3, 4)
_SUMMED_FIELDS = 8

# exposition sample -> cumulative counter (seconds unless named otherwise); `env_tool_s/` + tool
# is added per tool from the histogram's `tool` label
_SAMPLES = {
    "cj_serve_engine_step_seconds_total": "sampler_step_s",
    "cj_serve_prefill_seconds_total": "sampler_prefill_s",
    "cj_serve_prefill_compile_seconds_total": "sampler_compile_s",
    "cj_serve_tokenize_seconds_total": "sampler_tokenize_s",
    "cj_serve_http_seconds_total": "sampler_http_s",
    "cj_serve_http_thread_cpu_seconds_total": "sampler_http_cpu_s",
    "cj_serve_generation_tokens_total": "sampler_tokens",
    "cj_env_tool_call_seconds_sum": "env_tool_s",
    "cj_env_tool_call_seconds_count": "env_tool_calls",
    "cj_env_grade_seconds_sum": "env_grade_s",
    "cj_env_grade_seconds_count": "env_grades",
    "cj_env_session_create_seconds_sum": "env_session_s",
}

# every profile key (after PREFIX) and what it is; core<i>_busy and env_tool_s/<tool> per core / tool
KEYS = {
    "wall_s": "the interval's wall seconds (a step's: from the previous step's or evaluation's end to its end)",
    "trainer_cpu_s": "CPU seconds of the learner process, all threads (train step, rollout side, HTTP clients)",
    "core<i>_busy": "share of core i's time busy (not idle or iowait), whatever ran there",
    "sampler_prefill_s": "sampler engine seconds admitting requests (prefill and its first token, compilations)",
    "sampler_compile_s": "the part of sampler_prefill_s in admissions that compiled a new program",
    "sampler_decode_s": "sampler engine seconds decoding: engine step seconds minus prefill (forward and token "
    "sampling are one compiled program; the tokens' recording)",
    "sampler_tokenize_s": "serve handler seconds tokenising requests and detokenising answers",
    "sampler_http_s": "serve handler seconds JSON-decoding requests and JSON-encoding answers",
    "sampler_http_cpu_s": "CPU seconds of the serve replicas' HTTP event-loop threads (HTTP parsing included)",
    "sampler_tokens": "tokens the samplers generated",
    "env_tool_s": "environment tool-call seconds, summed over concurrent calls (per tool: env_tool_s/<tool>)",
    "env_tool_calls": "environment tool calls",
    "env_grade_s": "grading seconds, summed over concurrent gradings",
    "env_grades": "gradings run",
    "env_session_s": "session-creation seconds, summed over concurrent creations",
}


def core_jiffies(text: str, cores: Collection[int]) -> dict[int, tuple[int, int]]:
    """core -> (busy, total) jiffies since boot from a /proc/stat text, for `cores` (those without a
    `cpuN` line, e.g. offline, are left out)."""
    out: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cores:
            continue
        fields = [int(x) for x in rest.split()[:_SUMMED_FIELDS]]
        total = sum(fields)
        out[int(name[3:])] = (total - sum(fields[i] for i in _IDLE_FIELDS if i < len(fields)), total)
    return out


def busy_fractions(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]) -> dict[int, float]:
    """core -> the share of its jiffies between two `core_jiffies` readings that were busy (0 where
    no jiffy passed)."""
    out = {}
    for core in sorted(set(before) & set(after)):
        busy, total = after[core][0] - before[core][0], after[core][1] - before[core][1]
        out[core] = busy / total if total > 0 else 0.0
    return out


def counters_of(text: str) -> dict[str, float]:
    """The profile's cumulative counters (`_SAMPLES`' names) in one Prometheus exposition (a serve
    replica's or an environment server's /metrics), parsed by prometheus_client's own parser;
    series of one name (labels: a tool, an endpoint) are summed, tool-call seconds also kept per
    tool. Samples of other names are ignored."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = _SAMPLES.get(s.name)
            if key is None:
                continue
            out[key] = out.get(key, 0.0) + s.value
            if key == "env_tool_s" and "tool" in s.labels:
                per = f"env_tool_s/{s.labels['tool']}"
                out[per] = out.get(per, 0.0) + s.value
    return out


def counter_deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, float]:
    """Services' counters (service -> counters) summed over services, as the difference between two
    readings. A service absent before (started, or moved to another URL since) and a counter that
    went down (its process restarted) count from zero; a service absent after counts nothing
    (`Profile.mark` carries the earlier reading of one that did not answer forward).
    `sampler_decode_s` is `sampler_step_s - sampler_prefill_s` (the step's seconds are not kept)."""
    out: dict[str, float] = {}
    for service, now in after.items():
        then = before.get(service, {})
        for key, value in now.items():
            d = value - then.get(key, 0.0)
            out[key] = out.get(key, 0.0) + (value if d < 0 else d)
    if "sampler_step_s" in out:
        step = out.pop("sampler_step_s")
        out["sampler_decode_s"] = max(step - out.get("sampler_prefill_s", 0.0), 0.0)
    return out


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One reading: when (`time.perf_counter`), the cores' jiffies, the learner's CPU seconds and
    the services' counters."""

    when: float
    cores: dict[int, tuple[int, int]]
    cpu_s: float
    services: dict[str, dict[str, float]]


Scrape = Callable[[], Awaitable[Mapping[str, Mapping[str, float]]]]


class Profile:
    """Snapshots of `cores` (the learner's affinity set at its start) and of what `scrape` returns
    (the rollout side's `profile_counters`; None: no services, e.g. on processes other than 0);
    `mark` is the difference since the previous one (module docstring)."""

    def __init__(self, cores: Collection[int], scrape: Scrape | None = None, proc_stat: Path = PROC_STAT):
        self.cores, self.scrape, self.proc_stat = sorted(cores), scrape, proc_stat
        self.last: Snapshot | None = None

    async def snapshot(self) -> Snapshot:
        try:
            cores = core_jiffies(self.proc_stat.read_text(), self.cores)
        except OSError:  # no /proc (not Linux): no core figures
            cores = {}
        services = dict(await self.scrape()) if self.scrape is not None else {}
        return Snapshot(time.perf_counter(), cores, time.process_time(), {k: dict(v) for k, v in services.items()})

    async def start(self) -> None:
        """The first snapshot, unless one was taken (the step-0 evaluation's)."""
        if self.last is None:
            self.last = await self.snapshot()

    async def mark(self) -> dict[str, float]:
        """The `profile/...` values since the previous snapshot ({} for the first one)."""
        now, then = await self.snapshot(), self.last
        if then is not None:  # a service that did not answer now: its counts go to the next interval
            now.services.update({k: v for k, v in then.services.items() if k not in now.services})
        self.last = now
        if then is None:
            return {}
        out = {"wall_s": now.when - then.when, "trainer_cpu_s": now.cpu_s - then.cpu_s}
        out.update({f"core{c}_busy": f for c, f in busy_fractions(then.cores, now.cores).items()})
        out.update(counter_deltas(then.services, now.services))
        return {PREFIX + k: v for k, v in out.items()}

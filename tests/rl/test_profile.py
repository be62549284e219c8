"""runtime/profile.py: the cores' busy shares from /proc/stat texts (hand-worked numbers), the services'
counters from /metrics texts (prometheus_client's parser reads them; replicas' restarts and missed
scrapes), and `Profile.mark`'s intervals. The learner logging these keys is tests/rl/test_learner_step.py;
the whole chain with a serve replica and an environment server is the slow test at the end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

from composer_jax.runtime.profile import KEYS, Profile, busy_fractions, core_jiffies, counter_deltas, counters_of

# user nice system idle iowait irq softirq steal guest guest_nice
STAT_BEFORE = """cpu  999 0 999 9999 0 0 0 0 0 0
cpu0 100 0 50 800 50 0 0 0 0 0
cpu1 10 5 5 970 10 0 0 0 0 0
cpu2 1 1 1 1 1 0 0 0 0 0
intr 12345 1 2
ctxt 999
"""
STAT_AFTER = """cpu  1999 0 1999 19999 0 0 0 0 0 0
cpu0 160 0 70 850 60 5 5 0 0 0
cpu1 10 5 5 1070 10 0 0 0 20 0
cpu2 1 1 1 1 1 0 0 0 0 0
intr 22345 1 2
ctxt 1999
"""


def test_busy_fractions_of_two_proc_stat_readings() -> None:
    # cpu0: busy = total - idle - iowait = 150 of 1000, then 240 of 1150: 90 of 150 jiffies busy
    # cpu1: 20 of 1000, then 20 of 1100 (guest time is inside user time: not summed again): idle
    before, after = core_jiffies(STAT_BEFORE, {0, 1, 7}), core_jiffies(STAT_AFTER, {0, 1, 7})
    assert before == {0: (150, 1000), 1: (20, 1000)}  # the aggregate line, cpu2 and absent cpu7 left out
    assert after == {0: (240, 1150), 1: (20, 1100)}
    assert busy_fractions(before, after) == {0: pytest.approx(0.6), 1: 0.0}
    assert busy_fractions(before, before) == {0: 0.0, 1: 0.0}  # no jiffy passed: not a division by zero


SERVE_METRICS = """# HELP cj_serve_engine_step_seconds_total Seconds spent inside engine steps.
# TYPE cj_serve_engine_step_seconds_total counter
cj_serve_engine_step_seconds_total 10.5
# HELP cj_serve_prefill_seconds_total Prefill.
# TYPE cj_serve_prefill_seconds_total counter
cj_serve_prefill_seconds_total 2.5
# HELP cj_serve_prefill_compile_seconds_total Compiling.
# TYPE cj_serve_prefill_compile_seconds_total counter
cj_serve_prefill_compile_seconds_total 1.5
# HELP cj_serve_tokenize_seconds_total Tokenise.
# TYPE cj_serve_tokenize_seconds_total counter
cj_serve_tokenize_seconds_total 0.25
cj_serve_tokenize_seconds_created 1.7e9
# HELP cj_serve_http_seconds_total HTTP.
# TYPE cj_serve_http_seconds_total counter
cj_serve_http_seconds_total 0.125
# HELP cj_serve_requests_total Requests.
# TYPE cj_serve_requests_total counter
cj_serve_requests_total{endpoint="/v1/completions",status="200"} 40.0
"""


def env_metrics(read_s: float, bash_s: float, grade_s: float) -> str:
    return f"""# HELP cj_env_tool_call_seconds Tool call duration in seconds, by tool.
# TYPE cj_env_tool_call_seconds histogram
cj_env_tool_call_seconds_bucket{{le="1.0",tool="read_file"}} 3.0
cj_env_tool_call_seconds_bucket{{le="+Inf",tool="read_file"}} 3.0
cj_env_tool_call_seconds_count{{tool="read_file"}} 3.0
cj_env_tool_call_seconds_sum{{tool="read_file"}} {read_s}
cj_env_tool_call_seconds_bucket{{le="1.0",tool="bash"}} 1.0
cj_env_tool_call_seconds_bucket{{le="+Inf",tool="bash"}} 2.0
cj_env_tool_call_seconds_count{{tool="bash"}} 2.0
cj_env_tool_call_seconds_sum{{tool="bash"}} {bash_s}
# HELP cj_env_grade_seconds Grading duration in seconds.
# TYPE cj_env_grade_seconds histogram
cj_env_grade_seconds_bucket{{le="+Inf"}} 4.0
cj_env_grade_seconds_count 4.0
cj_env_grade_seconds_sum {grade_s}
"""


def test_counters_of_a_serve_and_an_env_exposition() -> None:
    assert counters_of(SERVE_METRICS) == {
        "sampler_step_s": 10.5,
        "sampler_prefill_s": 2.5,
        "sampler_compile_s": 1.5,
        "sampler_tokenize_s": 0.25,
        "sampler_http_s": 0.125,
    }
    env = counters_of(env_metrics(0.5, 3.0, 8.0))
    assert env == {
        "env_tool_s": 3.5,
        "env_tool_s/read_file": 0.5,
        "env_tool_s/bash": 3.0,
        "env_tool_calls": 5.0,
        "env_grade_s": 8.0,
        "env_grades": 4.0,
    }


def test_counter_deltas_over_services_restarts_and_decode() -> None:
    before = {"sampler a": counters_of(SERVE_METRICS), "env x": counters_of(env_metrics(0.5, 3.0, 8.0))}
    after = {
        # replica a: 4 more engine seconds of which 1 prefill
        "sampler a": {**before["sampler a"], "sampler_step_s": 14.5, "sampler_prefill_s": 3.5},
        # a second replica started meanwhile: everything since its start counts
        "sampler b": {"sampler_step_s": 2.0, "sampler_prefill_s": 0.5},
        # the environment server restarted: its counters went down, they count from zero
        "env x": counters_of(env_metrics(0.25, 1.0, 2.0)),
    }
    d = counter_deltas(before, after)
    assert d["sampler_decode_s"] == pytest.approx((4.0 - 1.0) + (2.0 - 0.5))
    assert d["sampler_prefill_s"] == pytest.approx(1.0 + 0.5) and "sampler_step_s" not in d
    assert d["sampler_tokenize_s"] == 0.0
    assert d["env_tool_s"] == pytest.approx(1.25) and d["env_tool_s/bash"] == pytest.approx(1.0)
    assert d["env_grade_s"] == pytest.approx(2.0) and d["env_grades"] == 0.0  # 4 -> 4: none since


def test_profile_marks_intervals(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    readings = iter(
        [
            {"sampler a": {"sampler_step_s": 1.0, "sampler_prefill_s": 0.5}, "env x": {"env_grade_s": 1.0}},
            {"sampler a": {"sampler_step_s": 3.0, "sampler_prefill_s": 1.0}},  # env x did not answer
            {"sampler a": {"sampler_step_s": 3.0, "sampler_prefill_s": 1.0}, "env x": {"env_grade_s": 4.0}},
        ]
    )

    async def scrape() -> dict:
        return next(readings)

    profile = Profile({0, 1}, scrape, proc_stat=stat)

    async def go() -> list[dict[str, float]]:
        stat.write_text(STAT_BEFORE)
        await profile.start()
        await profile.start()  # a second start keeps the first snapshot (no scrape taken)
        stat.write_text(STAT_AFTER)
        first = await profile.mark()
        stat.write_text(STAT_AFTER)
        return [first, await profile.mark()]

    first, second = asyncio.run(go())
    assert first["profile/core0_busy"] == pytest.approx(0.6) and first["profile/core1_busy"] == 0.0
    assert first["profile/sampler_decode_s"] == pytest.approx(1.5) and first["profile/sampler_prefill_s"] == 0.5
    assert first["profile/env_grade_s"] == 0.0  # env x did not answer: its counts wait for the next interval
    assert second["profile/env_grade_s"] == pytest.approx(3.0) and second["profile/sampler_decode_s"] == 0.0
    assert second["profile/core0_busy"] == 0.0
    assert first["profile/wall_s"] > 0 and first["profile/trainer_cpu_s"] >= 0
    documented = {k.split("/")[0].replace("<i>", "0") for k in KEYS}
    assert {k.removeprefix("profile/").split("/")[0] for k in first} <= documented | {"core1_busy"}


def test_in_process_samplers_counters_are_their_drivers_totals() -> None:
    from types import SimpleNamespace

    from composer_jax.rl.samplers.in_process import InProcessSamplers

    driver = SimpleNamespace(step_s=3.0, prefill_s=1.0, prefill_trace_s=0.25, tokens_generated=12)
    shared = SimpleNamespace(driver=driver)
    backend = InProcessSamplers([SimpleNamespace(sampler=shared), SimpleNamespace(sampler=shared)])  # type: ignore[list-item]
    got = asyncio.run(backend.profile_counters())
    want = {"sampler_step_s": 3.0, "sampler_prefill_s": 1.0, "sampler_compile_s": 0.25, "sampler_tokens": 12.0}
    assert got == {"in-process/0": want}


# slow: about 32 s (a serve replica and an environment server started, their programs compiled);
# the parts are covered by the tests above, tests/rl/test_learner_step.py (the learner logs the
# keys) and tests/inference/server/test_serve_metrics.py (the replica's counters)
@pytest.mark.slow
@needs_bwrap
def test_a_run_with_one_local_replica_logs_where_the_time_goes(tmp_path, monkeypatch) -> None:
    from composer_jax.config import load_config
    from composer_jax.report import write_report
    from composer_jax.rl.learner import run_rl

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    cfg = load_config(
        REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml",
        [f"train.out_dir={out}", "train.steps=1", "rl.local_samplers=1", "rl.eval_seeds=1"],
    )
    summary = run_rl(cfg, echo=lambda _: None)
    step = summary["steps"][1]
    for key in ("wall_s", "sampler_prefill_s", "sampler_decode_s", "sampler_tokenize_s", "sampler_http_s"):
        assert step[f"profile/{key}"] > 0, key
    assert step["profile/env_grade_s"] > 0 and step["profile/env_grades"] == 8  # 2 groups x 4 rollouts
    assert step["profile/sampler_http_cpu_s"] > 0
    assert any(k.endswith("_busy") for k in step)
    evals = [e for e in summary["evals"] if "eval/profile/wall_s" in e]
    assert len(evals) == 2 and all(e["eval/profile/sampler_decode_s"] > 0 for e in evals)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("profile/sampler_decode_s" in r for r in records)
    md = write_report(out).read_text()
    assert "#### Where the time goes" in md and "| step 1 |" in md and "| evaluation at 1 |" in md

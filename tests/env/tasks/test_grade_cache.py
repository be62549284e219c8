"""The grade cache (`env-server --grade-cache N`, tasks/grader.py `GradeCache`, `rl.env_grade_cache`):
a grade of a change equal to one graded before, on the same task, is that grade's verdict; every
other change is graded by its tests. Attacked as an agent would, through the public HTTP API."""

from __future__ import annotations

import pytest
from support.live_server import FIXTURE_TASKS, LiveServer, call, requires_bwrap
from support.metrics_scrape import parse

from composer_jax.env.tasks.grader import GradeCache, GradeResult, Job

FIX = '"""A tiny calculator."""\n\n\ndef add(a, b):\n    return a + b\n\n\ndef multiply(a, b):\n    return a * b\n'


def _result(**kw) -> GradeResult:
    base = dict(reward=1.0, tests=[], diff="", error=None, exit_code=0, timed_out=False, output_tail="", duration_s=0.1)
    return GradeResult(**{**base, **kw})


def test_the_cache_keeps_only_verdicts_the_tests_gave_and_forgets_the_oldest(tmp_path):
    from composer_jax.env.tasks.store import TaskStore

    task = TaskStore(FIXTURE_TASKS, tmp_path / "generated").get("fix-add")
    cache = GradeCache(2)
    assert GradeCache.key(task, Job(tmp_path), {}) is None  # no tree hash from the carry: never cached
    keys = [GradeCache.key(task, Job(tmp_path, carried_sha256=h), {}) for h in ("a", "b", "c")]
    assert len(set(keys)) == 3 and all(k is not None for k in keys)
    assert GradeCache.key(task, Job(tmp_path, carried_sha256="a"), {"key": "env2"}) != keys[0]  # another env
    excluded = [{"path": "x.pyc", "class": "bytecode"}]  # not carried: not what is graded
    assert GradeCache.key(task, Job(tmp_path, carried_sha256="a", excluded=excluded), {}) == keys[0]
    for bad in (_result(error="verifier timed out"), _result(timed_out=True), _result(tampering=[{"class": "x"}])):
        cache.put(keys[0], bad)
        assert cache.get(keys[0]) is None  # not a verdict the tests gave: never kept
    for k in keys:
        cache.put(k, _result(reward=float(k == keys[1])))
    assert len(cache) == 2 and cache.get(keys[0]) is None  # the oldest went
    got = cache.get(keys[1])
    assert got is not None and got.reward == 1.0
    got.reward = 0.0  # a copy: the kept verdict is not the caller's to change
    assert cache.get(keys[1]).reward == 1.0
    with pytest.raises(ValueError, match="grade cache capacity 0"):
        GradeCache(0)


SANDBOX, NEEDS_BWRAP = requires_bwrap


@SANDBOX
@NEEDS_BWRAP
@pytest.mark.parametrize("on", [True, False])
def test_an_equal_change_gets_the_first_verdict_and_any_other_change_its_own(on):
    server = LiveServer(*(["--grade-cache", "16"] if on else []))
    http = server.client()

    def graded(*commands: str) -> dict:
        sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
        for command in commands:
            assert call(http, sid, "run_shell", command=command)["ok"], command
        out = http.post(f"/sessions/{sid}/grade").json()
        http.delete(f"/sessions/{sid}")
        return out

    write_fix = "cat > calc.py <<'EOF'\n" + FIX + "EOF"
    try:
        fixed = graded(write_fix)
        assert fixed["reward"] == 1.0 and fixed["cached"] is False
        # the same carried tree (bytecode is never carried): the first verdict, when the cache is on
        again = graded(write_fix, "mkdir -p __pycache__ && printf junk > __pycache__/calc.cpython-311.pyc")
        assert again["reward"] == 1.0 and again["cached"] is on and again["tests"] == fixed["tests"]
        assert {e["class"] for e in again["excluded"]} == {"cache"} and fixed["excluded"] == []  # its own record
        if not on:
            return  # (off, the default: every grade runs its tests)
        # an agent after a cached 1 without the fix: every other tree is graded by its own tests
        for commands, reward in (
            ((), 0.0),  # nothing
            (("sed -i 's/a - b/a - b  # fixed/' calc.py",), 0.0),  # a comment that fixes nothing
            (("cat > calc.py <<'EOF'\n" + FIX + "import os\nos._exit(0)\nEOF",), 0.0),  # the fix, then exit at import
            ((write_fix, "printf 'X = 1\\n' > extra.py"), 1.0),  # the fix and another file: a tree of its own
            ((write_fix, "chmod +x calc.py"), 1.0),  # the fix with another mode: a tree of its own
        ):
            got = graded(*commands)
            assert got["cached"] is False and got["reward"] == reward, (commands, got["error"], got["tests"])
        assert graded(write_fix, "chmod +x calc.py")["cached"] is True  # that tree, graded before
        nothing = graded()
        assert nothing["reward"] == 0.0 and nothing["cached"] is True
        assert parse(http.get("/metrics").text)("cj_env_grade_cache_hits_total") == 3.0
    finally:
        server.stop()

"""`ProcessZeroWork` without processes: two threads stand in for two JAX processes, meeting in a
broadcast that hands every caller process 0's JSON (as `broadcast_json` does over devices). The real
two-process run is tests/rl/test_rl_multiprocess.py::test_a_setup_error_on_process_0_stops_both."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from composer_jax.multihost import ProcessZeroFailed, ProcessZeroWork, check_header, failure_header


class Meeting:
    """A broadcast between `n` threads: each call returns process 0's argument (as JSON), once every
    thread has called."""

    def __init__(self, n: int = 2):
        self.barrier, self.value = threading.Barrier(n), None

    def broadcast(self, lead: bool):
        def call(obj: Any) -> Any:
            if lead:
                self.value = json.loads(json.dumps(obj))
            self.barrier.wait(timeout=20)
            out = self.value
            self.barrier.wait(timeout=20)
            return out

        return call


def two_processes(body) -> list[Any]:
    """`body(work, lead)` (a coroutine function) on two threads as processes 0 and 1; each one's
    result or raised exception."""
    meeting, waits = Meeting(), [0, 0]

    def process(i: int) -> Any:
        def before() -> None:
            waits[i] += 1

        work = ProcessZeroWork(lead=i == 0, multi=True, before_share=before, broadcast=meeting.broadcast(i == 0))
        try:
            return asyncio.run(body(work, i == 0))
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(process, [0, 1]))
    assert waits == [waits[0]] * 2 and waits[0] > 0  # both waited (for a checkpoint commit) before each share
    return out


def test_an_error_in_process_0_work_reaches_the_other_at_the_next_share() -> None:
    ran: list[tuple[int, str]] = []

    async def body(work: ProcessZeroWork, lead: bool) -> dict:
        async def start_servers() -> None:
            ran.append((0 if lead else 1, "start"))
            raise OSError("tasks directory 'nowhere' does not exist")

        await work.run("starting the rollout side", start_servers)
        # after a failure process 0 skips its later work but keeps entering the shared points
        assert await work.run("evaluation", lambda: ran.append((0, "eval"))) is None
        return work.share({"groups": [0, 1]})

    p0, p1 = two_processes(body)
    assert ran == [(0, "start")]  # process 1 runs none of process 0's work
    assert isinstance(p0, OSError) and "nowhere" in str(p0)  # process 0 raises its own error
    assert isinstance(p1, ProcessZeroFailed)
    assert str(p1) == (
        "starting the rollout side: process 0 stopped the run: OSError: tasks directory 'nowhere' does not exist"
    )


def test_without_an_error_the_header_reaches_every_process() -> None:
    async def body(work: ProcessZeroWork, lead: bool) -> dict:
        taken = await work.run("step 0", lambda: {"groups": [4, 5], "values": {"loss": 0.5}})
        first = work.share(taken)
        second = work.share()  # a bare point (the setup's end): an empty header
        return {"first": first, "second": second}

    p0, p1 = two_processes(body)
    want = {"first": {"error": "", "groups": [4, 5], "values": {"loss": 0.5}}, "second": {"error": ""}}
    assert p0 == p1 == want


def test_a_later_failure_is_shared_at_the_point_after_it() -> None:
    """Process 0 fails between two steps (after the first share): the first share goes through, the
    second carries the error."""
    seen: list[dict] = []

    async def body(work: ProcessZeroWork, lead: bool) -> None:
        seen.append(work.share({"step": 1}))

        def evaluate() -> None:
            raise RuntimeError("evaluation server down")

        await work.run("the evaluation at step 1", evaluate)
        work.share({"step": 2})

    p0, p1 = two_processes(body)
    assert seen == [{"error": "", "step": 1}] * 2
    assert isinstance(p0, RuntimeError) and str(p0) == "evaluation server down"
    assert isinstance(p1, ProcessZeroFailed)
    assert str(p1) == "the evaluation at step 1: process 0 stopped the run: RuntimeError: evaluation server down"


def test_one_process_raises_at_once() -> None:
    work = ProcessZeroWork(lead=True, multi=False, broadcast=lambda _: pytest.fail("no broadcast with one process"))

    def fail() -> None:
        raise ValueError("bad env URL 'htp://x'")

    with pytest.raises(ValueError, match="htp://x"):
        work.call("starting the rollout side", fail)
    assert work.failed is None
    assert work.share({"groups": [1]}) == {"groups": [1]}


def test_header_helpers() -> None:
    h = failure_header("step 3", KeyError("task"))
    assert h == {"error": "KeyError: 'task'", "where": "step 3"}
    with pytest.raises(ProcessZeroFailed, match=r"^step 3: process 0 stopped the run: KeyError: 'task'$"):
        check_header(h)
    assert check_header({"error": "", "groups": [1]}) == {"error": "", "groups": [1]}

"""`checkpoint.multihost.scatter_arrays` over real JAX processes (CPU, gloo): each process ends with
exactly its rows of process 0's arrays and receives only their bytes. Slow: each case starts its
processes (~10-20 s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.multiprocess_launch import free_port, run_processes

WORKER = str(Path(__file__).resolve().parent / "support" / "scatter_worker.py")
ROW_BYTES = 6 * 4 + 6 * 4 + 6 * 2 * 3 * 4  # one row of tokens, advantages and routing (int32/float32)


def run(processes: int, devices: int, axes: str, sizes: str) -> list[list[int]]:
    port = str(free_port())
    outs = run_processes(
        [[sys.executable, WORKER, str(i), str(processes), str(devices), port, axes, sizes] for i in range(processes)],
        timeout=300,
    )
    lines = [[x for x in out.splitlines() if x.startswith("ok received=")] for out in outs]
    assert all(len(x) == 1 for x in lines), outs
    return [json.loads(x[0].removeprefix("ok received=")) for x in lines]


@pytest.mark.slow
def test_two_processes_each_receive_their_rows() -> None:
    # rows over (data 2, fsdp 2): process 1's two devices hold rows 4-7, two blocks of 2 rows
    got = run(2, 2, "data,fsdp", "2,2")
    assert got == [[0, 4 * ROW_BYTES]] * 2


@pytest.mark.slow
def test_a_replicated_axis_crosses_once() -> None:
    # rows over fsdp 2 only, replicated over t: process 1's two devices both hold rows 4-7; they
    # cross once (4 rows) and are copied to the second device there
    got = run(2, 2, "fsdp,t", "2,2")
    assert got == [[0, 4 * ROW_BYTES]] * 2


@pytest.mark.slow
def test_four_processes_of_one_device() -> None:
    # process 0 has one device: one round per receiving process, 2 rows each
    got = run(4, 1, "data", "4")
    assert got == [[0, 2 * ROW_BYTES, 2 * ROW_BYTES, 2 * ROW_BYTES]] * 4

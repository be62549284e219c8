"""The Makefile's installs (`make venv`). The main virtualenv takes the base, environment-server and
Ray locks in one pip call (Ray's dependencies resolve with the rest) and is installed again when
any of them changes. vLLM's virtualenv has a stamp of its own, touched only when its install
succeeded, so a failed install warns, lets `make` go on (vLLM is optional) and is tried again by the
next `make venv`; its CPU torch (`torch==2.13.0+cpu`, which PyPI does not serve) comes from
PyTorch's CPU wheel index, added to pip's own indexes only when they cannot resolve it (an
unreachable extra index costs retries on every package). Run against stand-in virtualenvs whose
`pip` (or `python`) records each call's arguments and fails or succeeds as told, call by call."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(venv: Path, *extra: str) -> subprocess.CompletedProcess:
    stamp = venv / ".installed"
    args = ["make", "--no-print-directory", "-C", str(ROOT), f"VLLM_VENV={venv}", *extra, str(stamp)]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def _stand_in(venv: Path, *pip_rcs: int) -> Path:
    """A virtualenv whose python runs and whose pip appends its arguments to `pip.args` (a line a call),
    then exits with the next of `pip_rcs` (the last one from then on)."""
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    rcs = " ".join(map(str, pip_rcs))
    (venv / "bin" / "pip").write_text(
        f'#!/bin/sh\necho "$@" >> "{venv}/pip.args"\nn=$(wc -l < "{venv}/pip.args")\n'
        f'set -- {rcs}\nwhile [ "$n" -gt 1 ] && [ $# -gt 1 ]; do shift; n=$((n - 1)); done\nexit $1\n'
    )
    for exe in ("python", "pip"):
        (venv / "bin" / exe).chmod(0o755)
    return venv


def test_a_failed_vllm_install_warns_is_not_stamped_and_is_retried(tmp_path):
    venv = _stand_in(tmp_path / "vllm", 1)
    for _ in range(2):  # unstamped: the second `make` tries again
        (venv / "pip.args").unlink(missing_ok=True)
        out = _make(venv)
        assert out.returncode == 0, out.stderr  # vLLM is optional: the main job goes on
        assert "warning: could not install vLLM" in out.stdout and (venv / "pip.args").exists()
        assert not (venv / ".installed").exists()
    no_venv = _make(tmp_path / "none", "PYTHON=false")  # the virtualenv itself cannot be made
    assert no_venv.returncode == 0 and "warning: could not install vLLM" in no_venv.stdout
    assert not (tmp_path / "none" / ".installed").exists()


def test_a_vllm_install_is_stamped_once_it_succeeds_with_torchs_cpu_index(tmp_path):
    venv = _stand_in(tmp_path / "vllm", 1, 0)  # pip's own indexes lack the +cpu torch: PyTorch's index then
    out = _make(venv)
    assert out.returncode == 0 and "warning" not in out.stdout, out.stdout + out.stderr
    assert (venv / ".installed").exists()
    first, second = ((venv / "pip.args").read_text().splitlines()[i].split() for i in (0, 1))
    assert "--extra-index-url" not in first and first[first.index("-r") + 1] == "locks/vllm.lock"
    assert second[second.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert second[second.index("-r") + 1] == "locks/vllm.lock" and "--no-deps" in second
    (venv / "pip.args").unlink()
    assert _make(venv).returncode == 0 and not (venv / "pip.args").exists()  # stamped: not installed again
    assert "torch==2.13.0+cpu" in (ROOT / "locks" / "vllm.lock").read_text().split()  # why the index is there


def test_pips_own_indexes_are_tried_first(tmp_path):
    venv = _stand_in(tmp_path / "vllm", 0)  # a mirror or wheel folder that carries the build: one call
    assert _make(venv).returncode == 0 and (venv / ".installed").exists()
    calls = (venv / "pip.args").read_text().splitlines()
    assert len(calls) == 1 and "--extra-index-url" not in calls[0].split()


def test_the_main_install_takes_the_ray_lock_with_the_base_and_environment_locks(tmp_path):
    venv = tmp_path / "venv"  # the main virtualenv: its python records `-m pip install ...` calls
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$@" >> "{venv}/python.args"\nexit 0\n')
    (venv / "bin" / "python").chmod(0o755)
    make = ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}"]
    stamp = str(venv / ".installed")
    out = subprocess.run([*make, stamp], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and (venv / ".installed").exists(), out.stdout + out.stderr
    first = (venv / "python.args").read_text().splitlines()[0].split()
    assert first[:3] == ["-m", "pip", "install"] and "--no-deps" not in first and "--target" not in first
    assert [first[i + 1] for i, a in enumerate(first) if a == "-r"] == [
        "locks/base.lock",
        "locks/env.lock",
        "locks/ray.lock",
    ]
    # stamped: up to date (`make -q` exits 0) until a lock changes (-W: as if the file had just been
    # modified); a file the install does not read leaves it up to date
    question = lambda *w: subprocess.run([*make, "-q", *w, stamp], capture_output=True, timeout=60).returncode
    assert question() == 0 and question("-W", "README.md") == 0
    assert question("-W", "locks/ray.lock") == 1 and question("-W", "locks/env.lock") == 1
    assert "ray==2.60.0" in (ROOT / "locks" / "ray.lock").read_text().split()

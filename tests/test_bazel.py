"""The Bazel build (BUILD, WORKSPACE, .bazelrc) works offline: `bazel query` lists the targets,
the kernels are a leaf, and `bazel test` runs the config tests (a model test when slow tests run).

Skipped where `bazel` is not installed (`make system-deps` installs Debian's bazel-bootstrap).
Bazel's outputs go under a temporary --output_user_root (never the checkout); pytest-xdist workers
take turns through a file lock, since one Bazel server serves one command at a time.
"""

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BAZEL = shutil.which("bazel")
pytestmark = pytest.mark.skipif(
    BAZEL is None, reason="bazel is not installed (`make system-deps` installs bazel-bootstrap)"
)

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_ROOT = Path(tempfile.gettempdir()) / f"composer_jax-bazel-{os.getuid()}"


@contextlib.contextmanager
def _one_at_a_time():
    OUTPUT_ROOT.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{OUTPUT_ROOT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def bazel(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # The tests run under this session's interpreter (the local Python toolchain reads it).
    env = {**os.environ, "COMPOSER_JAX_PYTHON": sys.executable}
    assert BAZEL is not None  # the module is skipped without it
    cmd = [BAZEL, f"--output_user_root={OUTPUT_ROOT}", "--max_idle_secs=60", *args]
    with _one_at_a_time():
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


def _labels(proc: subprocess.CompletedProcess) -> set[str]:
    return {line.strip() for line in proc.stdout.splitlines() if line.strip()}


def test_query_lists_the_targets():
    targets = _labels(bazel("query", "//..."))
    expected = {
        "//:composer_jax",
        "//:composer_jax_env",
        "//:pallas_kernels",
        "//:composer-jax",
        "//:tests_config_test_config",
        "//:tests_model_test_moe",
        "//:tests_model_test_flash",
        "//:tests_model_test_sharded",
        "//:tests_model_test_gpu_lowering",
    }
    assert expected <= targets, expected - targets
    assert not [t for t in targets if "fixtures" in t], "a test fixture became a test target"
    assert not (ROOT / "bazel-bin").exists(), "convenience symlinks in the checkout (.bazelrc)"


def test_pallas_kernels_is_a_leaf():
    deps = _labels(bazel("query", "deps(//:pallas_kernels)"))
    assert "//:pallas_kernels" in deps
    assert "//:composer_jax" not in deps
    assert not [d for d in deps if d.startswith("//:src/")], "pallas_kernels depends on src/"


def test_bazel_runs_the_config_tests():
    proc = bazel("test", "--nocache_test_results", "//:tests_config_test_config")
    assert "//:tests_config_test_config" in proc.stdout + proc.stderr
    assert "1 test passes" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_bazel_runs_a_model_test():
    proc = bazel("test", "--nocache_test_results", "//:tests_model_test_gpu_lowering", timeout=1200)
    assert "1 test passes" in proc.stdout + proc.stderr

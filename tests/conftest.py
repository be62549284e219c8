"""Test session setup: a fake 8-device CPU mesh, set before JAX initialises its backend; the shipped
tokenizer as a fixture (the data and formats tests); the bubblewrap check of the sandbox tests
(support/bwrap.py)."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's SPMD partitioner performance warnings
_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# The suite's programs are tiny models, so its time is mostly XLA:CPU compiling them, and most of
# that is LLVM optimising code that then runs for milliseconds. At LLVM -O0 the default suite took
# 18:08 on 2 cores against 27:12 at XLA's own level (same 897 passed); its results differ from that
# level's at float32 rounding (the tiny model's forward and gradient: 33 of 55 arrays, by at most
# 4.8e-7), which every tolerance here allows. COMPOSER_JAX_TEST_XLA_OPT=default keeps XLA's level
# (`make test-all` does); an optimisation level given in XLA_FLAGS is kept as given.
if os.environ.get("COMPOSER_JAX_TEST_XLA_OPT", "o0") != "default" and "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

try:  # the environment-server tests run without JAX
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    # Many tests compile the same programs (a stage run, then its resume, ...): a persistent
    # compilation cache shared by the xdist workers of one session saves most of that time.
    _cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests")
    jax.config.update("jax_compilation_cache_dir", _cache)
    # cached from 0.1 s of compiling: on a subset of the suite (tests/rl/algo, train/test_objective.py,
    # train/test_loop.py, model/test_lora.py, inference/engine/test_sampler.py; -n 2, cold cache) 106
    # and 113 s against 125 and 135 s at 1.0 s, 129 s at 0 (every trivial program written too)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
except ImportError:
    pass


@pytest.fixture(scope="session")
def tok_dir() -> str:
    return str(Path(__file__).resolve().parents[1] / "assets" / "tokenizer")


@pytest.fixture(scope="session")
def tok(tok_dir):
    from composer_jax.formats.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)


@pytest.fixture(scope="session")
def bwrap_required() -> None:
    """Skip, or fail where `make system-deps` would install it, a test that needs bubblewrap when it is
    missing (support/bwrap.py's `needs_bwrap`); session-scoped, so it runs before the servers start."""
    from support.bwrap import require_bwrap

    require_bwrap()

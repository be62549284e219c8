"""Test session setup: a fake 8-device CPU mesh, set before JAX initialises its backend."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's SPMD partitioner performance warnings
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

try:  # the environment-server tests run without JAX
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    # Many tests compile the same programs (a stage run, then its resume, ...): a persistent
    # compilation cache shared by the xdist workers of one session saves most of that time.
    _cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests")
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
except ImportError:
    pass

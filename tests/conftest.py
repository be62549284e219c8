"""Test session setup: a fake 8-device CPU mesh, set before JAX initialises its backend."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's SPMD partitioner performance warnings
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

try:  # the environment-server tests run without JAX
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
except ImportError:
    pass

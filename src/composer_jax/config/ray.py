"""The `rl.ray` section: where a run with `rl.placement: ray` (or `--placement ray`) places its fleet.

With `placement: ray` every environment server and every sampler replica the run starts is a Ray
actor (runtime/ray_placement.py) instead of a child process of the run (runtime/local.py): an
environment server asks for `env_server_cpus` CPUs and one unit of the custom resource
`env_server_resource` (a cluster operator puts it on the nodes meant for sandboxes), a replica
for `sampler_cpus` CPUs, `sampler_gpus` GPUs and one unit of `sampler_resource`. The learner
learns their URLs from the placement. `address` joins a running cluster (`ray://...` or
`HOST:PORT`; empty: `RAY_ADDRESS`, else a local cluster started by the run with enough of both
custom resources for its own fleet, so `--placement ray` works on a laptop).

Example (YAML):

    rl:
      placement: ray
      ray:
        address: ""                     # or auto / HOST:6379 / ray://HOST:10001; "" = RAY_ADDRESS or local
        namespace: composer-jax
        env_server_cpus: 1
        env_server_resource: env_server # "" = no custom resource (any node with the CPUs)
        sampler_cpus: 1
        sampler_gpus: 0                 # GPUs per replica
        sampler_resource: sampler       # "" = none
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

from composer_jax.errors import ConfigError

Placement = Literal["local", "ray"]
PLACEMENTS = ("local", "ray")
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]*$")
_BUILT_IN = ("CPU", "GPU", "memory", "object_store_memory")


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """Where Ray places the run's services (module docstring)."""

    address: str = ""
    namespace: str = "composer-jax"
    env_server_cpus: float = 1.0
    env_server_resource: str = "env_server"
    sampler_cpus: float = 1.0
    sampler_gpus: int = 0
    sampler_resource: str = "sampler"

    def __post_init__(self) -> None:
        validate_ray(self)


def validate_ray(c: RayConfig, prefix: str = "rl.ray") -> None:
    if not isinstance(c.address, str) or any(ch.isspace() for ch in c.address):
        raise ConfigError(
            f"{prefix}.address={c.address!r}: expected '' (RAY_ADDRESS or a local cluster), 'auto', HOST:PORT or "
            "ray://HOST:PORT"
        )
    if not isinstance(c.namespace, str) or not c.namespace:
        raise ConfigError(f"{prefix}.namespace={c.namespace!r}: expected a non-empty name")
    for name in ("env_server_cpus", "sampler_cpus"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{prefix}.{name}={value!r}: expected a number of CPUs >= 0")
    if isinstance(c.sampler_gpus, bool) or not isinstance(c.sampler_gpus, int) or c.sampler_gpus < 0:
        raise ConfigError(f"{prefix}.sampler_gpus={c.sampler_gpus!r}: expected an integer >= 0 (GPUs per replica)")
    for name in ("env_server_resource", "sampler_resource"):
        value = getattr(c, name)
        if not isinstance(value, str) or (value and (not _RESOURCE.match(value) or value in _BUILT_IN)):
            raise ConfigError(
                f"{prefix}.{name}={value!r}: expected a custom resource name (letters, digits, _ . : -; not one of "
                f"{', '.join(_BUILT_IN)}), or '' for none"
            )


def validate_placement(value: object, key: str = "rl.placement") -> None:
    if value not in PLACEMENTS:
        raise ConfigError(f"{key}={value!r} is not accepted; accepted: {', '.join(PLACEMENTS)}")

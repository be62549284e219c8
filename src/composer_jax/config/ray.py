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

The trainer has its own section, `train.ray`, read when `train.placement: ray` (`--placement ray`
on `pretrain`, `sft` and `rl`): one trainer actor per host (`hosts`, a STRICT_SPREAD placement
group: every host on its own node), each asking for `cpus_per_host` CPUs, `gpus_per_host` GPUs and
one unit of `resource` (runtime/ray_trainer.py):

    train:
      placement: ray
      ray:
        address: ""          # as rl.ray.address; the run's fleet (rl.placement: ray) joins the same cluster
        hosts: 2             # trainer processes, one per node (jax.distributed over them)
        cpus_per_host: 1
        gpus_per_host: 8     # every GPU of a node: one process drives them all
        resource: trainer    # "" = none
        start_timeout_s: 600 # placing the group (nodes autoscaled up included)
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
    _check_address(c.address, c.namespace, prefix)
    for name in ("env_server_cpus", "sampler_cpus"):
        _check_cpus(f"{prefix}.{name}", getattr(c, name))
    if isinstance(c.sampler_gpus, bool) or not isinstance(c.sampler_gpus, int) or c.sampler_gpus < 0:
        raise ConfigError(f"{prefix}.sampler_gpus={c.sampler_gpus!r}: expected an integer >= 0 (GPUs per replica)")
    for name in ("env_server_resource", "sampler_resource"):
        _check_resource(f"{prefix}.{name}", getattr(c, name))


@dataclasses.dataclass(frozen=True)
class TrainerRayConfig:
    """Where Ray places the trainer's hosts (module docstring)."""

    address: str = ""
    namespace: str = "composer-jax"
    hosts: int = 1
    cpus_per_host: float = 1.0
    gpus_per_host: int = 0
    resource: str = "trainer"
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        validate_trainer_ray(self)


def validate_trainer_ray(c: TrainerRayConfig, prefix: str = "train.ray") -> None:
    _check_address(c.address, c.namespace, prefix)
    if isinstance(c.hosts, bool) or not isinstance(c.hosts, int) or c.hosts < 1:
        raise ConfigError(f"{prefix}.hosts={c.hosts!r}: expected an integer >= 1 (trainer processes, one per node)")
    _check_cpus(f"{prefix}.cpus_per_host", c.cpus_per_host)
    if isinstance(c.gpus_per_host, bool) or not isinstance(c.gpus_per_host, int) or c.gpus_per_host < 0:
        raise ConfigError(f"{prefix}.gpus_per_host={c.gpus_per_host!r}: expected an integer >= 0 (GPUs per host)")
    _check_resource(f"{prefix}.resource", c.resource)
    value = c.start_timeout_s
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{prefix}.start_timeout_s={value!r}: expected a number of seconds > 0")


def _check_address(address: object, namespace: object, prefix: str) -> None:
    if not isinstance(address, str) or any(ch.isspace() for ch in address):
        raise ConfigError(
            f"{prefix}.address={address!r}: expected '' (RAY_ADDRESS or a local cluster), 'auto', HOST:PORT or "
            "ray://HOST:PORT"
        )
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"{prefix}.namespace={namespace!r}: expected a non-empty name")


def _check_cpus(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}={value!r}: expected a number of CPUs >= 0")


def _check_resource(key: str, value: object) -> None:
    if not isinstance(value, str) or (value and (not _RESOURCE.match(value) or value in _BUILT_IN)):
        raise ConfigError(
            f"{key}={value!r}: expected a custom resource name (letters, digits, _ . : -; not one of "
            f"{', '.join(_BUILT_IN)}), or '' for none"
        )


def validate_placement(value: object, key: str = "rl.placement") -> None:
    if value not in PLACEMENTS:
        raise ConfigError(f"{key}={value!r} is not accepted; accepted: {', '.join(PLACEMENTS)}")

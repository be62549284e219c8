"""The mesh section: device-mesh axis sizes (the model/mesh combinations that cannot work: `config/run.py`)."""

from __future__ import annotations

import dataclasses
import math

from composer_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes. One axis may be -1: it takes all devices the others leave."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def shape(self, num_devices: int) -> dict[str, int]:
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        free = [a for a, s in sizes.items() if s == -1]
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if len(free) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got -1 for {free}")
        if free:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh.{free[0]}=-1: the other axes multiply to {fixed}, which does not divide "
                    f"the {num_devices} devices; choose sizes whose product divides {num_devices}"
                )
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(
                f"mesh: data*fsdp*expert*context*tensor = {fixed} ({sizes}) but there are "
                f"{num_devices} devices; the product must equal the device count (or set one axis to -1)"
            )
        return sizes


def validate_mesh(mesh: MeshConfig) -> None:
    """The mesh section's own checks (sizes against the model and the devices: `config/run.py`)."""
    for a in MESH_AXES:
        v = getattr(mesh, a)
        if v != -1 and v < 1:
            raise ConfigError(f"mesh.{a}={v} must be a positive integer or -1 (all remaining devices)")

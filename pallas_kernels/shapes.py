"""Output types of the kernels' `pallas_call`s, valid inside `jax.shard_map` too."""

from __future__ import annotations

import jax


def out_struct(shape: tuple[int, ...], dtype, *inputs: jax.Array) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct that varies over every manual mesh axis any of `inputs` varies over.

    Inside a `shard_map` with `check_vma=True` (the default, and what the expert-parallel MoE
    block uses), `pallas_call` needs each output's manual-axis type; outside one the inputs vary
    over nothing and the type is ignored."""
    mats = [m for m in (getattr(jax.typeof(a), "mat", None) for a in inputs) if m is not None]
    if not mats:
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mats[0])(varying=varying))

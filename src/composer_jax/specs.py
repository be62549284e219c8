"""Typed array specs (shape, logical axes, initialiser, dtype) and the one way a tree of them
becomes shardings, ShapeDtypeStructs or zeros.

Three kinds of arrays are described by the same `ArraySpec`: the parameters
(`model.params.param_specs`, whose `ParamSpec` adds the optimiser's role), the KV cache
(`model.kv_cache.cache_specs`) and the train step's input batch (`train.step.batch_specs`). Each
tree of specs is placed by `shardings` (logical axes -> `ShardingRules` -> `NamedSharding`);
`abstract` and `zeros` build on it. Every spec is checked on the way, and an error names the
array by its path in the tree ("moe_layers/attn/q"), since a spec does not know its own name.

It sits with `sharding.py`, below `model/`, so that every package that describes arrays (the
model's parameters, `model/moe/`'s own block, the KV cache, the step's batch) speaks it without
importing the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from composer_jax.sharding import ShardingRules


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One array: its shape, one logical axis (or None: never split) per dimension, its
    initialiser and dtype (None: the tree's default, e.g. the model's param_dtype for parameters
    or its compute dtype for the KV cache)."""

    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]
    init: Literal["normal", "ones", "zeros"] = "zeros"
    dtype: str | None = None

    def stacked(self, n: int, axis: str = "layers") -> Any:
        """This spec with a leading axis of n (a stack of layers scanned over)."""
        return dataclasses.replace(self, shape=(n, *self.shape), logical_axes=(axis, *self.logical_axes))


@dataclasses.dataclass(frozen=True)
class ParamSpec(ArraySpec):
    """A parameter's `ArraySpec` (normal-initialised unless told otherwise; every axis named) and
    its role."""

    logical_axes: tuple[str, ...]
    init: Literal["normal", "ones", "zeros"] = "normal"
    # What the optimiser does with it: "weight" (matrices) gets weight decay; "norm" scales and the
    # "embedding" table do not; the "router_bias" (DeepSeek-V3's score-correction bias) has no
    # gradient and is moved only by the aux-loss-free rule (`moe.router_bias_update`).
    role: Literal["weight", "norm", "embedding", "router_bias"] = "weight"


def is_spec(x: Any) -> bool:
    return isinstance(x, ArraySpec)


def path_str(path) -> str:
    """A pytree key path as 'moe_layers/moe/gate' (the name used for init keys and reports)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def check_spec(name: str, spec: ArraySpec) -> None:
    """A spec must name one logical axis per dimension; the error names the array."""
    if len(spec.shape) != len(spec.logical_axes):
        raise ValueError(
            f"array spec {name!r}: shape {tuple(spec.shape)} has {len(spec.shape)} dimensions but logical axes "
            f"{tuple(spec.logical_axes)} name {len(spec.logical_axes)}; give one logical axis (or None) per dimension"
        )


S = TypeVar("S", bound=ArraySpec)


def spec_map(fn: Callable[[str, S], Any], specs: Any) -> Any:
    """`fn(path, spec)` over every spec of the tree (each checked first), keeping the tree's
    structure (dicts, registered dataclasses such as `KVCache`)."""

    def one(path, spec: S) -> Any:
        name = path_str(path)
        check_spec(name, spec)
        return fn(name, spec)

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)


def dtype_of(spec: ArraySpec, default: Any) -> jnp.dtype:
    return jnp.dtype(spec.dtype or default)


def shardings(specs: Any, mesh: Mesh, rules: ShardingRules | None = None) -> Any:
    """The tree of `NamedSharding`s: each array placed by its logical axes under `rules` (default
    rules when None). Parameters, the KV cache and the step's batch are all placed here."""
    rules = rules or ShardingRules.create()
    return spec_map(lambda _, s: rules.sharding(mesh, s.logical_axes, s.shape), specs)


def abstract(specs: Any, dtype: Any, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Any:
    """The tree of `jax.ShapeDtypeStruct`s (with `shardings` when a mesh is given); allocates
    nothing. dtype: the default of specs without their own."""
    if mesh is None:
        return spec_map(lambda _, s: jax.ShapeDtypeStruct(s.shape, dtype_of(s, dtype)), specs)
    placed = shardings(specs, mesh, rules)
    return jax.tree.map(
        lambda s, h: jax.ShapeDtypeStruct(s.shape, dtype_of(s, dtype), sharding=h), specs, placed, is_leaf=is_spec
    )


def zeros(specs: Any, dtype: Any, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Any:
    """The tree of zero arrays, each created directly on its sharding when a mesh is given (no
    host copy). dtype: the default of specs without their own."""

    def make() -> Any:
        return spec_map(lambda _, s: jnp.zeros(s.shape, dtype_of(s, dtype)), specs)

    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=shardings(specs, mesh, rules))()

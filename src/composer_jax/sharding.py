"""Mesh and sharding rules. The only module that knows mesh axis names.

Every parameter and activation dimension carries a logical axis name (`embed`, `heads`, `experts`,
`act_batch`...). One `ShardingRules` object maps logical axes to mesh axes; changing a parallelism
strategy is editing that mapping. A mapping that would use one mesh axis twice in one array is
rejected with the array's logical axes named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import MESH_AXES, ConfigError, MeshConfig

MeshAxes = tuple[str, ...]

# Default mapping. Parameters: FSDP over the model dimension, tensor parallel over heads / MLP,
# experts over the expert axis (EP decoupled from TP, as in the report). Activations: batch over
# every data-like axis (the expert axis acts as data parallel outside MoE layers), sequence over
# the context axis, heads over tensor.
DEFAULT_RULES: dict[str, MeshAxes] = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "q_lora": (),
    "kv_lora": (),
    # the LoRA rank as the *input* of q_b / kv_b: FSDP-sharded there (q_a / kv_a already use fsdp
    # on embed, so their output rank stays whole); otherwise these would be replicated at tensor=1
    "lora_in": ("fsdp",),
    # a LoRA adapter's rank axis (model/lora.py): small, whole on every device
    "lora_rank": (),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "router_experts": (),
    "layers": (),
    "mtp": (),
    "embed_concat": (),
    # activations
    "act_batch": ("data", "fsdp", "expert"),
    "act_seq": ("context",),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_head_dim": (),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_topk": (),
    "act_experts": (),
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> tuple of mesh axes (empty tuple = replicated)."""

    rules: Mapping[str, MeshAxes]
    # logical axes whose mapping the user gave (config `sharding_rules`), as opposed to defaults
    explicit: frozenset[str] = frozenset()

    @classmethod
    def create(cls, overrides: Mapping[str, Any] | None = None) -> ShardingRules:
        rules = dict(DEFAULT_RULES)
        for name, axes in (overrides or {}).items():
            if name not in DEFAULT_RULES:
                raise ConfigError(
                    f"sharding_rules: unknown logical axis {name!r}; accepted: {', '.join(sorted(DEFAULT_RULES))}"
                )
            if axes is None:
                axes = ()
            elif isinstance(axes, str):
                axes = (axes,)
            axes = tuple(axes)
            for a in axes:
                if a not in MESH_AXES:
                    raise ConfigError(
                        f"sharding_rules.{name}: unknown mesh axis {a!r}; accepted: {', '.join(MESH_AXES)}"
                    )
            if len(set(axes)) != len(axes):
                raise ConfigError(f"sharding_rules.{name}={list(axes)} uses a mesh axis twice")
            rules[name] = axes
        return cls(rules, frozenset((overrides or {}).keys()))

    def mapped_axes(self, logical: str) -> MeshAxes:
        """The mesh axes the rules map a logical axis to, whatever their sizes on a mesh (the axes
        of size > 1 that split it on one mesh: `MeshRules.split_axes`)."""
        try:
            return tuple(self.rules[logical])
        except KeyError:
            raise ConfigError(f"unknown logical axis {logical!r}; accepted: {', '.join(sorted(self.rules))}") from None

    def spec(
        self,
        logical_axes: Sequence[str | None],
        shape: Sequence[int] | None = None,
        mesh: Mesh | AbstractMesh | None = None,
    ) -> P:
        """PartitionSpec for an array with these logical axes.

        With `shape` and `mesh`, mesh axes that do not divide a dimension are dropped for that
        dimension (it stays replicated there) so odd sizes such as a vocabulary of 129280 still
        place; the divisibility that matters for correctness (heads, experts) is checked at config
        load, and `dropped_axes` reports what was dropped (`inspect` lists it for every parameter;
        an explicit `sharding_rules` entry that applies nowhere is warned about at init). A mesh
        axis used twice in one array is an error.
        """
        return self._place(logical_axes, shape, mesh)[0]

    def dropped_axes(
        self, logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh | AbstractMesh
    ) -> list[tuple[str, str, int]]:
        """(logical axis, mesh axis, dimension size) for every mesh axis of size > 1 that the rules
        map a dimension to but that does not divide it, so that dimension is not split over it."""
        return self._place(logical_axes, shape, mesh)[1]

    def _place(
        self, logical_axes: Sequence[str | None], shape: Sequence[int] | None, mesh: Mesh | AbstractMesh | None
    ) -> tuple[P, list[tuple[str, str, int]]]:
        used: dict[str, str] = {}
        parts: list[Any] = []
        dropped: list[tuple[str, str, int]] = []
        for i, name in enumerate(logical_axes):
            if name is None:
                parts.append(None)
                continue
            axes = self.mapped_axes(name)
            if mesh is not None:
                axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if shape is not None and mesh is not None:
                kept, prod = [], 1
                for a in axes:
                    if shape[i] % (prod * mesh.shape[a]) == 0:
                        kept.append(a)
                        prod *= mesh.shape[a]
                    else:
                        dropped.append((name, a, int(shape[i])))
                axes = tuple(kept)
            for a in axes:
                if a in used:
                    raise ConfigError(
                        f"sharding rules map mesh axis {a!r} twice in one array with logical axes "
                        f"{tuple(logical_axes)} (via {used[a]!r} and {name!r}); change sharding_rules so "
                        f"each mesh axis appears at most once per array"
                    )
                used[a] = name
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*parts), dropped

    def sharding(
        self, mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None
    ) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes, shape, mesh))


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, expert, context, tensor); sizes from the config.

    Axis types are Auto (GSPMD propagation): the model annotates activations with logical
    constraints, and explicit collectives live in shard_map blocks (MoE dispatch).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_cfg.shape(len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    except Exception:  # device layouts make_mesh cannot tile (e.g. a subset): plain reshape
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """A mesh and the rules that place logical axes on it: the one way sharding enters the model.

    Model functions take `sharding: MeshRules | None` (None: everything as on one device). The
    public entry points (`forward`, the train and eval steps) resolve it once: an explicit one, or
    the mesh set with `jax.set_mesh` and the default rules (`MeshRules.resolve`). Nothing below
    them looks for an ambient mesh.
    """

    mesh: Mesh | AbstractMesh
    rules: ShardingRules = dataclasses.field(default_factory=ShardingRules.create)

    @staticmethod
    def resolve(sharding: MeshRules | None) -> MeshRules | None:
        """`sharding`, else the mesh set by `jax.set_mesh` with the default rules, else None."""
        if sharding is not None:
            return sharding
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            return None
        return MeshRules(mesh)

    def size(self, axis: str) -> int:
        """Size of a mesh axis (1 if the mesh has no such axis)."""
        return int(dict(self.mesh.shape).get(axis, 1))

    def split_axes(self, logical: str) -> MeshAxes:
        """The mesh axes of size > 1 that a logical axis is split over on this mesh (the rules'
        mapping, whatever the sizes: `ShardingRules.mapped_axes`)."""
        return tuple(a for a in self.rules.mapped_axes(logical) if self.size(a) > 1)

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> P:
        """PartitionSpec by logical axes; also the in/out specs of this project's `shard_map`s
        (a dimension that a block sees whole is `None` there)."""
        return self.rules.spec(logical_axes, shape, self.mesh)

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        """with_sharding_constraint by logical axes."""
        spec = self.spec(logical_axes, x.shape)
        if isinstance(self.mesh, Mesh):
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        return jax.lax.with_sharding_constraint(x, spec)


def constrain(x: jax.Array, sharding: MeshRules | None, logical_axes: Sequence[str | None]) -> jax.Array:
    """`sharding.constrain(x, logical_axes)`; a no-op without a mesh."""
    return x if sharding is None else sharding.constrain(x, logical_axes)


def batch_axes(rules: ShardingRules, mesh: Mesh | AbstractMesh) -> MeshAxes:
    """Mesh axes (of size > 1) over which the batch is split."""
    return tuple(a for a in rules.mapped_axes("act_batch") if mesh.shape[a] > 1)


def axis_size(mesh: Mesh | AbstractMesh, axes: Sequence[str]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def vary_like(x: jax.Array, *like: jax.Array) -> jax.Array:
    """Inside shard_map: mark x as varying over every manual mesh axis that any of `like` varies
    over (`jax.lax.pcast`), e.g. so a scan's initial carry has the type of its per-step output, or
    a custom VJP sees operands of one type (autodiff transposes the cast, a psum). Outside
    shard_map nothing varies and x is returned as is."""
    want = set()
    for y in like:
        want |= set(jax.typeof(y).manual_axis_type.varying)
    extra = tuple(sorted(want - set(jax.typeof(x).manual_axis_type.varying)))
    return jax.lax.pcast(x, extra, to="varying") if extra else x

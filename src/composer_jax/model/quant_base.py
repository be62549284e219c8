"""A LoRA run's frozen base in a block format (`train.lora.base_format`: the QLoRA recipe, Dettmers
et al. 2023, arXiv 2305.14314, with the project's MX / NVFP4 formats in place of NF4).

Which weights: the linear kernels of the layer stacks (`dense_layers`, `moe_layers`, `mtp`): the
attention projections, the dense MLP, the shared and the routed experts, MTP's `eh_proj`, as QLoRA
quantises a model's linear layers. Float stay: norms, the router and its bias (the routing scores
are float32 and a top-k choice flips on small errors), the embedding table (a gather: a quantised
table would be dequantised whole for a lookup) and the output head (its error lands on the logits
unfiltered), as bitsandbytes leaves a model's embeddings and head.

How: each such weight W [*batch, *in, *out] (batch: the layers / MTP depth and experts axes) is a
`QuantWeight`, the blocks taken along its last input axis (the contraction: what a block-scaled
matmul would read; attention's `o` contracts [heads, head_dim] and is blocked along head_dim):
  - mxfp8: E4M3 elements, an E8M0 scale per 32 (1 + 1/32 bytes per weight),
  - mxfp4: E2M1 elements packed two per byte, an E8M0 scale per 32 (1/2 + 1/32 bytes),
  - nvfp4: E2M1 packed, an E4M3 scale per 16 and a float32 scale per matrix (each layer's, each
    expert's: its own "tensor") (1/2 + 1/16 bytes + 4 per matrix).
The MX scales use the "ceil" rule (quant/formats.py): the block maximum never saturates, where the
OCP rule clips it (E2M1: values in (6, 8) x 2^s to 6, up to 25 % off) for one bit more of range.

The static part of a `QuantWeight` names the quantised axis from the end and the non-batch shape
only, so the `lax.scan` over a layer stack slices it like an array (data, scales and the second
scale all keep the leading batch axes), and the layer body dequantises one layer at a time
(`dequantized`, called by `transformer.decoder_layer` and `mtp_block`): the float copy of the base
exists one layer at a time. Gradients never reach it (the step differentiates the adapters).

`dequantized(base)` of the whole tree is "the dequantised float base": what the forward computes
with, number for number (the dequantisation is exact float32 arithmetic, then the original dtype);
samplers, exports and serve replicas take it (`TrainState.model_params`, `hf.lora_export`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from composer_jax import specs as array_specs
from composer_jax.config import ModelConfig
from composer_jax.config.lora import BASE_FORMATS
from composer_jax.model.params import param_specs
from composer_jax.quant.formats import MX_BLOCK, NVFP4_BLOCK, QuantArray, dequantize, mx_quantize, nvfp4_quantize
from composer_jax.sharding import ShardingRules
from composer_jax.specs import ArraySpec, ParamSpec

STACKS = ("dense_layers", "moe_layers", "mtp")  # the scanned stacks whose kernels are quantised
BATCH_AXES = ("layers", "mtp", "experts")  # leading axes a weight is a stack of matrices over
MX_FORMATS = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4"}  # base_format -> quant/formats.py's name
MX_RULE = "ceil"  # (module docstring)

# base_format -> (bits per stored element, block size, scale dtype)
LAYOUT = {
    "mxfp8": (8, MX_BLOCK, "uint8"),
    "mxfp4": (4, MX_BLOCK, "uint8"),
    "nvfp4": (4, NVFP4_BLOCK, "float8_e4m3fn"),
}
assert set(LAYOUT) == set(BASE_FORMATS) - {"none"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """One frozen weight in a block format: quant/formats.py's `QuantArray` layout (`data`: the
    quantised axis moved last and padded to whole blocks; `scales` [..., blocks]; NVFP4's float32
    `second` [*batch, 1, ..., 1], else None), with static fields that leading (batch) axes do not
    enter: `fmt` (the base_format), `axis` (the quantised axis, negative: counted from the end),
    `tail` (the original shape without its batch axes) and `dtype` (the original dtype, what
    `dequantize` returns). The same container holds specs or shardings leaf for leaf."""

    data: Any
    scales: Any
    second: Any
    fmt: str = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    tail: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))

    def dequantize(self) -> jax.Array:
        """The float weight, [*batch, *tail] in `dtype`, for whatever batch axes `data` still has."""
        shape = tuple(self.data.shape[: self.data.ndim - len(self.tail)]) + self.tail
        name = MX_FORMATS.get(self.fmt, self.fmt)
        q = QuantArray(self.data, self.scales, self.second, name, len(shape) + self.axis, shape)
        return dequantize(q).astype(self.dtype)


STORED_FIELDS = ("data", "scales", "second")  # a QuantWeight's arrays (their last path part)


def is_quant(x: Any) -> bool:
    return isinstance(x, QuantWeight)


def quantised_axis(path: str, spec: ParamSpec) -> tuple[int, int] | None:
    """(batch axes, the quantised axis) of parameter `path` when the base format quantises it
    (module docstring), else None."""
    parts = path.split("/")
    if parts[0] not in STACKS or spec.role != "weight" or parts[-1].startswith("router"):
        return None
    batch = 0
    while batch < len(spec.logical_axes) and spec.logical_axes[batch] in BATCH_AXES:
        batch += 1
    if len(spec.shape) - batch < 2:
        return None
    n_in = 2 if parts[-1] == "o" and "attn" in parts else 1  # (model/lora.py's `_in_dims`)
    return batch, batch + n_in - 1


def _moved(t: tuple, axis: int) -> tuple:
    return t[:axis] + t[axis + 1 :] + (t[axis],)


def _weight_spec(spec: ParamSpec, fmt: str, batch: int, axis: int, dtype: str) -> QuantWeight:
    """The `QuantWeight` of `ArraySpec`s one weight is stored as (shapes, logical axes, dtypes)."""
    bits, block, scale_dtype = LAYOUT[fmt]
    shape, axes = _moved(spec.shape, axis), _moved(spec.logical_axes, axis)
    n = shape[-1]
    blocks = -(-n // block)
    padded = blocks * block
    data = ArraySpec(shape[:-1] + (padded * bits // 8,), axes, dtype="float8_e4m3fn" if bits == 8 else "uint8")
    scales = ArraySpec(shape[:-1] + (blocks,), axes, dtype=scale_dtype)
    second = None
    if fmt == "nvfp4":
        second = ArraySpec(shape[:batch] + (1,) * (len(shape) - batch), axes[:batch] + (None,) * (len(shape) - batch))
        second = dataclasses.replace(second, dtype="float32")
    return QuantWeight(data, scales, second, fmt, axis - len(spec.shape), tuple(spec.shape[batch:]), dtype)


def base_specs(m: ModelConfig, fmt: str) -> dict[str, Any]:
    """The frozen base's tree of specs under `fmt`: `param_specs` with every quantised weight a
    `QuantWeight` of specs ("none": `param_specs` itself)."""
    specs = param_specs(m)
    if fmt == "none":
        return specs

    def one(path: str, spec: ParamSpec) -> Any:
        where = quantised_axis(path, spec)
        if where is None:
            return spec
        return _weight_spec(spec, fmt, *where, str(array_specs.dtype_of(spec, m.param_dtype)))

    return array_specs.spec_map(one, specs)


def base_shardings(m: ModelConfig, fmt: str, mesh: Mesh, rules: ShardingRules | None = None) -> Any:
    """Shardings of the frozen base's leaves (a stored weight by its own layout's logical axes: a
    dimension its mesh axes do not divide stays whole, `ShardingRules`)."""
    return array_specs.shardings(base_specs(m, fmt), mesh, rules)


def abstract_base(m: ModelConfig, fmt: str) -> Any:
    return array_specs.abstract(base_specs(m, fmt), m.param_dtype)


def quantize_weight(x: jax.Array, fmt: str, batch: int, axis: int) -> QuantWeight:
    """One weight [*batch, ...] quantised along `axis` (module docstring)."""
    if fmt == "nvfp4":
        q = nvfp4_quantize(x, axis, second=tuple(range(batch, x.ndim)))
    else:
        q = mx_quantize(x, MX_FORMATS[fmt], axis, rule=MX_RULE)
    return QuantWeight(q.data, q.scales, q.second, fmt, axis - x.ndim, tuple(x.shape[batch:]), str(x.dtype))


def quantize_base(base: dict, m: ModelConfig, fmt: str) -> dict:
    """The float base `base` (the model's parameter tree) with every weight `quantised_axis`
    names a `QuantWeight` ("none": `base` itself). Pure: jit it with `base_shardings`."""
    if fmt == "none":
        return base
    plan = {p: quantised_axis(p, s) for p, s in _flat_specs(m).items()}

    def one(path, x):
        where = plan.get(array_specs.path_str(path))
        return x if where is None else quantize_weight(x, fmt, *where)

    return jax.tree_util.tree_map_with_path(one, base)


def _flat_specs(m: ModelConfig) -> dict[str, ParamSpec]:
    out: dict[str, ParamSpec] = {}

    def keep(path: str, spec: ParamSpec) -> None:
        out[path] = spec

    array_specs.spec_map(keep, param_specs(m))
    return out


def quantized_base(
    base: dict, m: ModelConfig, fmt: str, mesh: Mesh | None = None, rules: ShardingRules | None = None
) -> dict:
    """`quantize_base` compiled once, on `base_shardings` when a mesh is given."""
    if fmt == "none":
        return base
    fn = lambda b: quantize_base(b, m, fmt)
    if mesh is None:
        return jax.jit(fn)(base)
    return jax.jit(fn, out_shardings=base_shardings(m, fmt, mesh, rules))(base)


def dequantized(tree: Any, compute_dtype: Any = None, param_dtype: Any = None) -> Any:
    """`tree` with every `QuantWeight` dequantised to its original dtype, then (given both) cast to
    `compute_dtype` where that dtype is `param_dtype`, as `transformer.compute_params` casts a
    float weight. A tree without quantised leaves comes back as it is."""
    if not any(is_quant(x) for x in jax.tree.leaves(tree, is_leaf=is_quant)):
        return tree

    def one(x: Any) -> Any:
        if not is_quant(x):
            return x
        # materialised as it is (the barrier): XLA would otherwise fold the dequantisation's layout
        # into the consumer's matmul, which then sums in another order than over the float base's
        # weight (float32 rounding apart, measured); with it the forward equals the dequantised
        # float base's exactly
        w = jax.lax.optimization_barrier(x.dequantize())
        if compute_dtype is not None and jnp.dtype(x.dtype) == jnp.dtype(param_dtype):
            w = w.astype(compute_dtype)
        return w

    return jax.tree.map(one, tree, is_leaf=is_quant)


def dequantized_base(base: dict, mesh: Mesh | None = None, m: ModelConfig | None = None, rules=None) -> dict:
    """The whole float base (the dequantised copy a sampler or an export takes), compiled once;
    on the model's parameter shardings when `mesh` and `m` are given."""
    if not any(is_quant(x) for x in jax.tree.leaves(base, is_leaf=is_quant)):
        return base
    if mesh is None or m is None:
        return jax.jit(dequantized)(base)
    from composer_jax.model.params import param_shardings

    return jax.jit(dequantized, out_shardings=param_shardings(m, mesh, rules))(base)


def stored_bytes(tree: Any) -> int:
    """Bytes of every array of `tree` as stored (codes, scales, second scales and float leaves);
    arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def quantised_bytes(tree: Any) -> tuple[int, int]:
    """(bytes stored for the quantised weights, bytes of those weights in their original dtype)."""
    stored = original = 0
    for x in jax.tree.leaves(tree, is_leaf=is_quant):
        if is_quant(x):
            stored += stored_bytes(x)
            original += (
                math.prod(tuple(x.data.shape[: x.data.ndim - len(x.tail)]) + x.tail) * jnp.dtype(x.dtype).itemsize
            )
    return stored, original

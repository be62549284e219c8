"""The choice of how an MoE layer computes its routed experts, as a pure function of the few facts
that decide it (`choose_dispatch`), so the decision table is stated once and tested row by row.

The candidates (`Dispatch`):
  - DECODE: an inference step on a device holding every expert, unquantised: `decode.decode_swiglu`,
    every expert's weights read at most once and in place (`decode.LayerView`s of the stack);
  - DECODE_EXPERT_PARALLEL: an unquantised inference step on an expert-parallel mesh: the dropless
    all-gather / reduce-scatter of `decode.decode_expert_parallel` instead of the training exchange;
  - GATHERED: a training block with fewer assignments than experts (every expert local, "auto",
    unquantised): each assignment through its own expert's gathered weights
    (`grouped.gathered_swiglu`), which reads only the experts in use; exact;
  - TILED_FROM_TOKENS: the "tiled" grouped matmul on one device, straight from the tokens by
    gathers only (`grouped.tiled_dispatch_swiglu`);
  - SORTED: the assignments sorted by expert, exchanged over the expert axis when there is one
    (`expert_parallel`), through `grouped.grouped_swiglu` with `model.moe_impl` and back.
"""

from __future__ import annotations

import enum

import jax

ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


class Dispatch(enum.Enum):
    DECODE = "decode"
    DECODE_EXPERT_PARALLEL = "decode_expert_parallel"
    GATHERED = "gathered"
    TILED_FROM_TOKENS = "tiled_from_tokens"
    SORTED = "sorted"


def on_accelerator() -> bool:
    """Whether JAX runs on a GPU or TPU (where `ragged_dot` and `ragged_all_to_all` are real ops;
    XLA:CPU emulates the first with G x the FLOPs and lacks the second)."""
    return jax.default_backend() in ACCELERATORS


def grouped_impl(impl: str, accelerator: bool) -> str:
    """`model.moe_impl` with "auto" resolved: the ragged grouped GEMM on GPU/TPU, tiles on XLA:CPU."""
    if impl != "auto":
        return impl
    return "ragged" if accelerator else "tiled"


def choose_dispatch(
    *, impl: str, precision: str, ep: int, decode: bool, assignments: int, experts: int, accelerator: bool
) -> Dispatch:
    """The dispatch of one MoE layer's block. impl: `model.moe_impl`; precision:
    `model.moe_precision`; ep: devices the experts are split over; decode: an inference step (a
    `forward_cached`); assignments: the block's tokens x k; experts: `model.num_experts`;
    accelerator: `on_accelerator()`. The specialised paths apply only to "auto" without
    quantisation; quantised and explicitly named implementations take the training dispatch."""
    plain_local = ep == 1 and impl == "auto" and precision == "bf16"
    if decode and plain_local:
        return Dispatch.DECODE
    if decode and ep > 1 and precision == "bf16":
        return Dispatch.DECODE_EXPERT_PARALLEL
    if plain_local and assignments < experts:
        return Dispatch.GATHERED
    if ep == 1 and grouped_impl(impl, accelerator) == "tiled":
        return Dispatch.TILED_FROM_TOKENS
    return Dispatch.SORTED

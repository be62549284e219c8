"""The MoE dispatch decision table (`moe.dispatch.choose_dispatch`), one row per case: which way a
block computes its routed experts from `model.moe_impl`, `model.moe_precision`, the expert-parallel
degree, whether the forward is an inference step, the block's assignments against the experts, and
the platform. The rows marked "auto ->" are those where "auto" resolves to a grouped matmul (tiles on
XLA:CPU, ragged on GPU/TPU) before the choice; the layer's outputs on each path are held to a numpy
reference in test_moe.py, test_moe_decode.py and test_expert_parallel.py."""

from __future__ import annotations

import pytest

from composer_jax.model.moe.dispatch import Dispatch, choose_dispatch, grouped_impl

D, DEP, G, T, S = (
    Dispatch.DECODE,
    Dispatch.DECODE_EXPERT_PARALLEL,
    Dispatch.GATHERED,
    Dispatch.TILED_FROM_TOKENS,
    Dispatch.SORTED,
)

# (impl, precision, ep, decode, assignments, experts, accelerator) -> dispatch
TABLE = [
    # inference steps, every expert local
    ("auto", "bf16", 1, True, 64, 8, False, D),
    ("auto", "bf16", 1, True, 2, 8, False, D),  # few assignments: decode still wins
    ("auto", "bf16", 1, True, 4096, 8, True, D),
    ("tiled", "bf16", 1, True, 64, 8, False, T),  # a named impl takes the training dispatch
    ("ragged", "bf16", 1, True, 64, 8, False, S),
    ("auto", "mxfp8", 1, True, 64, 8, False, T),  # quantised: auto -> tiled on CPU
    ("auto", "mxfp8", 1, True, 64, 8, True, S),  # quantised: auto -> ragged on GPU
    # inference steps, experts split over a mesh axis
    ("auto", "bf16", 4, True, 64, 8, False, DEP),
    ("tiled", "bf16", 4, True, 64, 8, True, DEP),
    ("dense", "bf16", 4, True, 2, 8, False, DEP),
    ("auto", "mxfp8", 4, True, 64, 8, False, S),  # quantised: the training exchange
    ("auto", "nvfp4_fwd_mxfp8_bwd", 4, True, 64, 8, True, S),
    # training blocks, every expert local
    ("auto", "bf16", 1, False, 4, 8, False, G),  # fewer assignments than experts
    ("auto", "bf16", 1, False, 4, 8, True, G),
    ("auto", "bf16", 1, False, 8, 8, False, T),  # as many as experts: auto -> tiled
    ("auto", "bf16", 1, False, 64, 8, False, T),  # auto -> tiled on CPU
    ("auto", "bf16", 1, False, 64, 8, True, S),  # auto -> ragged on GPU
    ("tiled", "bf16", 1, False, 4, 8, True, T),  # named tiled: no gathered shortcut, any platform
    ("ragged", "bf16", 1, False, 64, 8, False, S),
    ("dense", "bf16", 1, False, 4, 8, False, S),
    ("auto", "mxfp8", 1, False, 4, 8, False, T),  # quantised: no gathered shortcut
    ("tiled", "mxfp8", 1, False, 64, 8, False, T),
    ("ragged", "nvfp4_fwd_mxfp8_bwd", 1, False, 64, 8, True, S),
    # training blocks, experts split over a mesh axis: always sorted and exchanged
    ("auto", "bf16", 4, False, 4, 8, False, S),
    ("auto", "bf16", 4, False, 64, 8, True, S),
    ("tiled", "bf16", 4, False, 64, 8, False, S),
    ("auto", "mxfp8", 2, False, 64, 8, False, S),
]


@pytest.mark.parametrize("impl, precision, ep, decode, assignments, experts, accelerator, want", TABLE)
def test_dispatch_table(impl, precision, ep, decode, assignments, experts, accelerator, want):
    got = choose_dispatch(
        impl=impl,
        precision=precision,
        ep=ep,
        decode=decode,
        assignments=assignments,
        experts=experts,
        accelerator=accelerator,
    )
    assert got is want


@pytest.mark.parametrize(
    "impl, accelerator, want",
    [("auto", False, "tiled"), ("auto", True, "ragged"), ("dense", True, "dense"), ("tiled", True, "tiled")],
)
def test_auto_resolves_per_platform(impl, accelerator, want):
    assert grouped_impl(impl, accelerator) == want

"""bench/hlo_dots.py: the matrix-product inventory that `bench/train_step.py` turns into a floor."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from hlo_dots import Dot, bmm_layout, dot_inventory, time_dots  # noqa: E402


def _compiled(f, *args) -> str:
    text = jax.jit(f).lower(*args).compile().as_text()
    assert text is not None
    return text


def test_inventory_counts_loop_trips_and_flops():
    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 32), jnp.float32)
    q = jnp.ones((4, 16, 8), jnp.float32)
    k = jnp.ones((4, 24, 8), jnp.float32)

    def f(x, w, q, k):
        def body(h, _):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, x, None, length=5)
        s = jnp.einsum("bqd,bkd->bqk", q, k)
        return h.sum() + s.sum()

    dots, notes = dot_inventory(_compiled(f, x, w, q, k))
    assert notes == []
    by_flops = {d.flops: c for d, c in dots.items()}
    # the scanned product runs 5 times (5 x 2*64*32*32 FLOPs); the batched one once
    assert by_flops[2 * 64 * 32 * 32] == 5, dots
    assert by_flops[2 * 4 * 16 * 24 * 8] == 1, dots
    assert sum(d.flops * c for d, c in dots.items()) == 5 * 2 * 64 * 32 * 32 + 2 * 4 * 16 * 24 * 8
    timed = time_dots(dots, repeats=1, inner=2)
    assert {d for d, _, _ in timed} == set(dots) and all(t > 0 for _, _, t in timed)
    pytest.importorskip("torch")
    from hlo_dots import time_dots_torch

    theirs = time_dots_torch(dots, repeats=1)
    assert set(theirs) == set(dots) and all(t > 0 for t in theirs.values())


def test_unknown_trip_count_is_reported():
    x = jnp.ones((16, 16), jnp.float32)

    def f(x, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ c[0], c[1] + 1), (x, 0))[0]

    dots, notes = dot_inventory(_compiled(f, x, 3))
    assert list(dots.values()) == [1]
    assert len(notes) == 1 and "no known trip count" in notes[0]


@pytest.mark.parametrize(
    "lhs,rhs,lc,rc,lb,rb",
    [
        ((5, 7), (7, 3), (1,), (0,), (), ()),
        ((7, 5), (3, 7), (0,), (1,), (), ()),
        ((2, 7, 5), (2, 3, 7), (1,), (2,), (0,), (0,)),
        ((5, 2, 7, 4), (4, 7, 2, 3), (2, 3), (1, 0), (1,), (2,)),
    ],
)
def test_bmm_layout_is_dot_general(lhs, rhs, lc, rc, lb, rb):
    """The batched-matmul form the torch side is timed in computes the same product."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(lhs), rng.standard_normal(rhs)
    dot = Dot("f32", lhs, rhs, lc, rc, lb, rb)
    want = np.asarray(
        jax.lax.dot_general(
            jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), ((lc, rc), (lb, rb)), precision="highest"
        )
    )
    lhs_order, rhs_order, (bsz, m, k, n) = bmm_layout(dot)
    got = np.transpose(a, lhs_order).reshape(bsz, m, k) @ np.transpose(b, rhs_order).reshape(bsz, k, n)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)
    assert dot.flops == 2 * bsz * m * k * n == 2 * np.prod(want.shape) * np.prod([lhs[i] for i in lc])


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        dot_inventory("HloModule m\n")

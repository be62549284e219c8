"""losses.fused_linear_cross_entropy against numpy (values) and jax.grad of the plain path (gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.train import losses


def _numpy_ce(h, w, t, wt, z_loss):
    logits = np.einsum("bsd,dv->bsv", h.astype(np.float64), w.astype(np.float64))
    m = logits.max(-1, keepdims=True)
    log_z = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    tl = np.take_along_axis(logits, t[..., None], -1)[..., 0]
    nll = ((log_z - tl) * wt).sum()
    z = (z_loss * log_z**2 * wt).sum()
    correct = ((logits.argmax(-1) == t) * wt).sum()
    return nll, z, wt.sum(), correct


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_fused_matches_reference(chunks, z_loss):
    b, s, d, v = 2, 8, 16, 40
    kh, kw, kt, km = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(kh, (b, s, d))
    w = jax.random.normal(kw, (d, v)) * 0.3
    t = jax.random.randint(kt, (b, s), 0, v)
    wt = (jax.random.uniform(km, (b, s)) > 0.3).astype(jnp.float32)  # some positions masked out

    loss, nll, z, ws, correct = losses.fused_linear_cross_entropy(h, w, t, wt, z_loss, chunks)
    ref = _numpy_ce(np.asarray(h), np.asarray(w), np.asarray(t), np.asarray(wt), z_loss)
    np.testing.assert_allclose([float(nll), float(z), float(ws), float(correct)], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), ref[0] + ref[1], rtol=1e-5)

    def plain(w, h):
        n, zz, _, _ = losses.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), t, wt, z_loss)
        return 3.0 * (n + zz)  # a cotangent other than 1 reaches the custom backward

    fused = lambda w, h: 3.0 * losses.fused_linear_cross_entropy(h, w, t, wt, z_loss, chunks)[0]
    g_ref = jax.grad(plain, argnums=(0, 1))(w, h)
    g = jax.jit(jax.grad(fused, argnums=(0, 1)))(w, h)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-6)


def test_chunks_must_divide_seq():
    h, w = jnp.zeros((1, 6, 4)), jnp.zeros((4, 5))
    with pytest.raises(ValueError, match="chunks=4"):
        losses.fused_linear_cross_entropy(h, w, jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6)), 0.0, 4)


@pytest.mark.parametrize("chunks", [1, 4])
def test_the_nll_per_group_matches_numpy_and_leaves_the_rest_unchanged(chunks):
    b, s, d, v, n_groups = 2, 8, 16, 40, 3
    kh, kw, kt, km, kg = jax.random.split(jax.random.key(1), 5)
    h = jax.random.normal(kh, (b, s, d))
    w = jax.random.normal(kw, (d, v)) * 0.3
    t = jax.random.randint(kt, (b, s), 0, v)
    wt = (jax.random.uniform(km, (b, s)) > 0.3).astype(jnp.float32)
    g = jax.random.randint(kg, (b, s), 0, n_groups)
    plain = losses.fused_linear_cross_entropy(h, w, t, wt, 1e-2, chunks)
    *same, by_group = losses.fused_linear_cross_entropy(h, w, t, wt, 1e-2, chunks, g, n_groups)
    for a, r in zip(same, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))  # the other values bit for bit
    hn, wn, tn, wtn, gn = (np.asarray(x) for x in (h, w, t, wt, g))
    ref = [_numpy_ce(hn, wn, tn, wtn * (gn == k), 0.0)[0] for k in range(n_groups)]
    np.testing.assert_allclose(np.asarray(by_group), ref, rtol=1e-5, atol=1e-5)
    *_, by_group_plain = losses.cross_entropy(jnp.einsum("bsd,dv->bsv", h, w), t, wt, 0.0, g, n_groups)
    np.testing.assert_allclose(np.asarray(by_group_plain), ref, rtol=1e-5, atol=1e-5)
    grads = [
        jax.grad(lambda w, extra=extra: losses.fused_linear_cross_entropy(h, w, t, wt, 1e-2, chunks, *extra)[0])(w)
        for extra in ((), (g, n_groups))
    ]
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))

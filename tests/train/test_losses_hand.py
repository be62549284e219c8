"""losses.shifted_targets and losses.self_distillation on inputs small enough to work out by hand
(the arithmetic is in the comments)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.train import losses

# Row 0: two packed documents (segments 1 and 2, three tokens each) then two padding tokens; the
# target at position 2 is masked out, and the padding's loss_mask is 1 (the segment check alone must
# keep padding out). Row 1: one document filling the row.
TOKENS = np.array([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]], np.int32)
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3]], np.int32)
LOSS_MASK = np.array([[1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)

# weight[i] = loss_mask[i + k] * (segments[i..i+k] all equal and not padding); past the row end the
# target is 0 with weight 0.
#
# k = 1, row 0: targets tokens[1:] + [0]; loss_mask[1:] + [0] = 1 0 1 1 1 1 1 0;
#   same segment as the next token: i=0,1 (1,1) yes; i=2 (1 -> 2) no; i=3,4 (2,2) yes;
#   i=5 (2 -> 0) no; i=6 (0,0) is padding: no; i=7 padding: no  -> 1 0 0 1 1 0 0 0
#   (i=1 is in-segment but its target, position 2, is masked out)
# k = 1, row 1: one segment; only i=7 has no next token          -> 1 1 1 1 1 1 1 0
# k = 2, row 0: targets tokens[2:] + [0, 0]; loss_mask[2:] + [0, 0] = 0 1 1 1 1 1 0 0;
#   segments[i..i+2]: i=0 (1,1,1) yes, i=1 (1,1,2) no, i=2 (1,2,2) no, i=3 (2,2,2) yes,
#   i=4 (2,2,0) no, i=5 (2,0,0) no, i=6, 7 padding no             -> 0 0 0 1 0 0 0 0
#   (i=0 is in-segment but its target, position 2, is masked out)
# k = 2, row 1: i=6, 7 have no token two ahead                   -> 1 1 1 1 1 1 0 0
EXPECTED = {
    1: (
        [[11, 12, 13, 14, 15, 16, 17, 0], [21, 22, 23, 24, 25, 26, 27, 0]],
        [[1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]],
    ),
    2: (
        [[12, 13, 14, 15, 16, 17, 0, 0], [22, 23, 24, 25, 26, 27, 0, 0]],
        [[0, 0, 0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]],
    ),
}


@pytest.mark.parametrize("k", [1, 2])
def test_shifted_targets_by_hand(k):
    targets, weights = losses.shifted_targets(jnp.asarray(TOKENS), jnp.asarray(SEGMENTS), jnp.asarray(LOSS_MASK), k)
    want_t, want_w = EXPECTED[k]
    assert targets.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(targets), want_t)
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(want_w, np.float32))


# self_distillation over a 3-token vocabulary, logits [batch 2, seq 2, vocab 3]:
#   token (0,0): teacher [ln 2, 0, 0] -> p = [2, 1, 1] / 4 = [1/2, 1/4, 1/4]; student [0, 0, 0] -> q = 1/3 each
#                KL = 1/2 ln(3/2) + 2 * 1/4 ln(3/4) = 1/2 ln(9/8)
#   token (0,1): teacher [0, 0, ln 2] -> p = [1/4, 1/4, 1/2]; student [ln 2, 0, 0] + 5 (a shift changes
#                nothing) -> q = [1/2, 1/4, 1/4]; KL = 1/4 ln(1/2) + 0 + 1/2 ln 2 = 1/4 ln 2
#   token (1,0): student = teacher + 3 -> KL = 0
#   token (1,1): very different, but weight 0
# weights [[1, 2], [1, 0]]: kl_sum = 1/2 ln(9/8) + 2 * 1/4 ln 2 = 1/2 ln(9/4) = ln(3/2); weight_sum = 4
LN2 = math.log(2.0)
TEACHER = np.array([[[LN2, 0, 0], [0, 0, LN2]], [[0.3, -1.2, 2.0], [9.0, 0, 0]]], np.float32)
STUDENT = np.array([[[0, 0, 0], [LN2 + 5, 5, 5]], [[3.3, 1.8, 5.0], [0, 9.0, 0]]], np.float32)
WEIGHTS = np.array([[1, 2], [1, 0]], np.float32)


def test_self_distillation_by_hand():
    kl_sum, w_sum = losses.self_distillation(jnp.asarray(STUDENT), jnp.asarray(TEACHER), jnp.asarray(WEIGHTS))
    chex.assert_trees_all_close((kl_sum, w_sum), (jnp.float32(math.log(1.5)), jnp.float32(4.0)), rtol=1e-6)


def test_self_distillation_gradients_by_hand():
    """d KL(p || q) / d student_logits = q - p per token (times its weight); the teacher is stopped.
    (0,0): q - p = [1/3 - 1/2, 1/3 - 1/4, 1/3 - 1/4] = [-1/6, 1/12, 1/12]
    (0,1): weight 2 x ([1/2, 1/4, 1/4] - [1/4, 1/4, 1/2]) = [1/2, 0, -1/2]
    (1,0): q = p -> 0;  (1,1): weight 0 -> 0."""

    def kl(student, teacher):
        return losses.self_distillation(student, teacher, jnp.asarray(WEIGHTS))[0]

    g_student, g_teacher = jax.grad(kl, argnums=(0, 1))(jnp.asarray(STUDENT), jnp.asarray(TEACHER))
    want = np.array([[[-1 / 6, 1 / 12, 1 / 12], [0.5, 0, -0.5]], [[0, 0, 0], [0, 0, 0]]], np.float32)
    chex.assert_trees_all_close(g_student, jnp.asarray(want), atol=1e-6)
    chex.assert_trees_all_close(g_teacher, jnp.zeros_like(g_teacher))

"""vLLM's `prompt_logprobs` for `/v1/completions`: the log-probability of every prompt token given
the ones before it, under the served weights.

The engine's prefill computes logits for the last prompt position only (all a sampler needs), so
the prompt's are a separate forward pass of the served parameters over the prompt: one jitted
program per length bucket (a power of two, at least 16), the padding in its own segment. What
a teacher in on-policy distillation answers (`rl/algo/distill.py`): the student's sampled tokens
sent as the prompt, their log-probabilities under the teacher read back.

Log-probabilities are of the raw logits (no temperature, top-k or top-p), as vLLM's default
`logprobs_mode` (raw_logprobs) returns them. The response shape is vLLM's: per choice a list with
one entry per prompt token, None for the first (nothing predicts it), else
{"<token id>": {"logprob": float, "rank": int, "decoded_token": str}} (rank 1 = the most likely
token). Only `prompt_logprobs: 0` (the prompt token itself) is computed; top alternatives are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ModelConfig
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.model.transformer import forward
from composer_jax.sharding import MeshRules

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The padded length a prompt of n tokens is scored at: the next power of two, at least 16."""
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


class PromptScorer:
    """log p(prompt[i] | prompt[:i]) and its rank for i >= 1, under given parameters of `cfg`."""

    def __init__(self, cfg: ModelConfig, sharding: MeshRules | None = None):
        self.cfg, self.sharding = cfg, sharding
        self._programs: dict[int, Any] = {}

    def _program(self, length: int) -> Any:
        if length not in self._programs:

            def score(params: Any, tokens: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
                logits = forward(params, tokens, self.cfg, segment_ids=segment_ids, sharding=self.sharding).logits
                logits = logits[:, :-1].astype(jnp.float32)
                target = tokens[:, 1:]
                chosen = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
                logp = chosen - jax.nn.logsumexp(logits, axis=-1)
                rank = 1 + jnp.sum(logits > chosen[..., None], axis=-1)
                return logp, rank

            self._programs[length] = jax.jit(score)
        return self._programs[length]

    def __call__(self, params: Any, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(logp float32[n - 1], rank int[n - 1]) of prompt tokens 1..n-1."""
        n = len(prompt)
        length = bucket(n)
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = prompt
        segment_ids = np.zeros((1, length), np.int32)
        segment_ids[0, :n] = 1
        logp, rank = self._program(length)(params, jnp.asarray(tokens), jnp.asarray(segment_ids))
        return np.asarray(logp)[0, : n - 1], np.asarray(rank)[0, : n - 1]


def prompt_logprobs_field(
    tok: Tokenizer, prompt: Sequence[int], logp: np.ndarray, rank: np.ndarray
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` list for one prompt (module docstring)."""
    out: list[dict[str, dict] | None] = [None]
    for t, lp, r in zip(prompt[1:], logp, rank):
        out.append({str(int(t)): {"logprob": float(lp), "rank": int(r), "decoded_token": tok.decode([int(t)])}})
    return out

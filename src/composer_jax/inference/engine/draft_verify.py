"""MTP speculative decoding: the MTP module drafts k tokens, the main model verifies them in one
cached pass of k + 1 tokens per slot, and the speculative-sampling rule keeps the output
distribution exactly the model's (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", sec. 2.3; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling", algorithm 2).

The rule, per slot, with p_i the main model's processed distribution (temperature, top-k, top-p
applied, `token_sampling.processed_logprobs`) for the token after draft i - 1 and q_i the same
processing of the MTP module's distribution that draft x_i was drawn from:
  accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order; at the first rejection draw
  the token from norm(max(0, p_i - q_i)) and stop; if all k are accepted, draw a bonus token from
  p_{k+1}. Greedy slots accept while the draft is the arg-max of p and end with p's arg-max.
Every token so emitted has the distribution p given its prefix, so speculation changes the speed,
not the samples' law.

Drafting (DeepSeek-V3 sec. 2.2 and 5.4.3 use the MTP module for speculative decoding): MTP module
1 at position j takes (t_{j+1}, h_j) and predicts t_{j+2}. After a verify pass the main model's
hidden states of every confirmed position are known, so module 1 runs over the confirmed positions
(writing its KV cache with exactly the training inputs) and its output at the newest one gives
draft 1. Drafts 2..k reuse module 1 chained one position further each time, its own normed
hidden state standing in for the main model's (the head's input in both cases; EAGLE's and vLLM's
chaining): the reference and DeepSeek-V3 models have one MTP module, and chaining lets k exceed
it. Cache entries a chained draft writes lie past the module's confirmed length and are rewritten
before anything reads them (`kv_cache.cached_visibility`). Modules 2..D of a deeper MTP stack are
not used for drafting (each would need its own cache lagging d - 1 positions behind).

Draft vocabulary (optional, FR-Spec: Zhao et al. 2025, "Accelerating Large-Vocabulary Language
Models via Frequency-Ranked Speculative Sampling"): the drafts' head is the shared output head
restricted to a list of token ids (e.g. the most frequent ones), so a draft reads |draft vocab|
columns of the head instead of all of them. At batch 1 the head dominates a draft's cost (the
reference model: 8.2M of the ~9.5M parameters an MTP draft reads). q is then zero outside the
list; the rule above is exact for any q, so the output distribution is unchanged.

Random numbers: every uniform comes from (request seed, token position, stream) with
`token_sampling.token_uniforms`: a draft for position P is drawn from q with stream 0 (the uniform the
non-speculative sampler would use at P, so a draft distribution equal to p reproduces its tokens),
the accept test uses stream 1, the residual draw stream 2, the bonus token stream 0. Each position
is finalised once, by uniforms no earlier decision looked at, which is what the rule's exactness
needs; so the distribution is exact and the tokens reproducible per (seed, prompt, k), but they
may differ from non-speculative sampling with the same seed (standard for speculative sampling).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.inference.engine.token_sampling import (
    argmax_first,
    draw,
    inverse_cdf,
    processed_logprobs,
    sampled_or_greedy,
    token_uniforms,
)
from composer_jax.model.kv_cache import KVCache
from composer_jax.model.layers import linear
from composer_jax.model.transformer import logits_of, mtp_forward_cached, output_head
from composer_jax.sharding import MeshRules


@dataclasses.dataclass
class SpecStats:
    """Counts over a sampler's verify steps (one slot's verify pass = one step).

    proposed[d] / accepted[d]: drafts at depth d + 1 proposed / accepted (a draft after a rejected
    one counts as proposed and not accepted, so the rate at depth d is P(at least d accepted));
    steps: slot verify passes; tokens: tokens they emitted (accepted drafts + 1 each)."""

    proposed: np.ndarray
    accepted: np.ndarray
    steps: int = 0
    tokens: int = 0

    @classmethod
    def zeros(cls, k: int) -> SpecStats:
        return cls(np.zeros(k, np.int64), np.zeros(k, np.int64))

    @property
    def acceptance_rate(self) -> list[float]:
        """Per depth 1..k: drafts accepted / drafts proposed (nan before any step)."""
        return [float(a / p) if p else float("nan") for a, p in zip(self.accepted, self.proposed)]

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per slot verify pass (1 + mean accepted drafts)."""
        return self.tokens / self.steps if self.steps else float("nan")

    def add(self, accepted: np.ndarray) -> None:
        """accepted: int[slots] drafts accepted by each verifying slot this step."""
        k = len(self.proposed)
        self.proposed += len(accepted)
        self.accepted += (accepted[:, None] > np.arange(k)[None, :]).sum(0)
        self.steps += len(accepted)
        self.tokens += int(accepted.sum()) + len(accepted)


def verify_drafts(
    p_lp: jax.Array,
    q_lp: jax.Array,
    drafts: jax.Array,
    temperature: jax.Array,
    seeds: jax.Array,
    lengths: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The accept/resample rule for one verify step.

    p_lp: float32[S, k+1, V] processed main-model log-probabilities, p_lp[:, i] the distribution of
    the token at index lengths + i + 1 (after the slot's last token and drafts 1..i); q_lp:
    float32[S, k, V] the processed draft distributions, drafts: int32[S, k] drawn from them (draft i
    is the token at index lengths + i + 1); temperature: float32[S] (0 = greedy); seeds: uint32[S];
    lengths: int32[S] the index of each slot's last token.
    Returns (accepted int32[S] in 0..k; tokens int32[S, k+1]: the accepted drafts, then the token
    drawn at index `accepted`, then zeros; their log-probabilities under p float32[S, k+1])."""
    s, k1, _ = p_lp.shape
    k = k1 - 1
    index = lengths[:, None] + 1 + jnp.arange(k1, dtype=jnp.int32)[None, :]  # token index per step i
    flat = lambda x: jnp.broadcast_to(x[:, None], (s, k1)).reshape(-1)
    uniforms = lambda stream: token_uniforms(flat(seeds), index.reshape(-1), stream).reshape(s, k1)
    p_at = jnp.take_along_axis(p_lp[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_at = jnp.take_along_axis(q_lp, drafts[..., None], axis=-1)[..., 0]
    # accept iff u <= p/q with u uniform on (0, 1]: probability min(1, p/q); in logs, so a tiny p
    # or q neither underflows nor divides by zero (p = 0: never accepted)
    sampled_ok = jnp.log(uniforms(1)[:, :k]) + q_at <= p_at
    greedy_ok = drafts == argmax_first(p_lp[:, :k])
    ok = jnp.where(temperature[:, None] > 0, sampled_ok, greedy_ok)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

    rows = jnp.arange(s)
    p_next = jnp.exp(p_lp[rows, accepted])  # [S, V]: p at the first rejected draft, or the bonus
    q_next = jnp.exp(q_lp[rows, jnp.minimum(accepted, k - 1)])
    rejected = accepted < k
    residual = jnp.where(rejected[:, None], jnp.maximum(p_next - q_next, 0.0), p_next)
    # p == q (to rounding) leaves no residual mass, and then a rejection had probability 0
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_next)
    u = jnp.where(rejected, uniforms(2)[rows, accepted], uniforms(0)[rows, accepted])
    new = sampled_or_greedy(temperature, argmax_first(p_next), lambda: inverse_cdf(residual, u))
    tokens = _emitted(drafts, accepted, new)
    logprobs = jnp.take_along_axis(p_lp, tokens[..., None], axis=-1)[..., 0]
    return accepted, tokens, logprobs


def draft(
    params: dict,
    cfg: ModelConfig,
    mtp_cache: KVCache,
    hidden: jax.Array,
    next_tokens: jax.Array,
    new_lengths: jax.Array,
    k: int,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    sharding: MeshRules | None = None,
    draft_head: tuple[jax.Array, jax.Array] | None = None,
    experts: int | None = None,
) -> tuple[KVCache, jax.Array, jax.Array]:
    """Bring MTP module 1's cache up to the confirmed tokens and draft the next k.

    mtp_cache: lengths L[S] (module 1's states of positions 0..L-1 are cached); hidden: [S, W,
    embed] the main model's final hidden states at positions L..L+W-1; next_tokens: int32[S, W]
    the token after each of those positions; new_lengths: int32[S] the confirmed length m after
    this step (positions L..m-1 of the window are real, m - L <= W; the rest is padding). Draft 1
    comes from the window's position m - 1, drafts 2..k from module 1 chained at m, m+1, ...
    draft_head: (ids int32[Vd], the output head's columns of those ids [embed, Vd]) when drafts
    are restricted to a draft vocabulary (`draft_head_columns`); None: the whole vocabulary.
    experts: routed experts per token in module 1's MoE block while drafting (`draft_model`); None:
    the model's own num_experts_per_tok.
    Returns (the cache with lengths m, drafts int32[S, k] (draft i is the token at index m + i),
    their processed distributions float32[S, k, V])."""
    if experts is not None:
        params, cfg = draft_model(params, cfg, experts)
    old = mtp_cache.lengths
    h_normed, mtp_cache = mtp_forward_cached(params, hidden, next_tokens, cfg, mtp_cache, sharding=sharding)
    last = jnp.clip(new_lengths - 1 - old, 0, next_tokens.shape[1] - 1)
    h = jnp.take_along_axis(h_normed, last[:, None, None], axis=1)  # [S, 1, embed] at position m - 1
    drafts, dists = [], []
    for i in range(k):
        u = token_uniforms(seeds, new_lengths + i + 1)
        if draft_head is None:
            q = processed_logprobs(logits_of(params, h[:, 0], cfg), temperature, top_k, top_p)
            d = draw(q, temperature, u)
        else:
            draft_vocab, columns = draft_head
            q_sub = processed_logprobs(
                linear(h[:, 0], columns, preferred_element_type=jnp.float32), temperature, top_k, top_p
            )
            d = draft_vocab[draw(q_sub, temperature, u)]
            q = jnp.full((h.shape[0], cfg.vocab_size), -jnp.inf, q_sub.dtype).at[:, draft_vocab].set(q_sub)
        drafts.append(d)
        dists.append(q)
        if i < k - 1:  # module 1 one position further: (draft i, its own head input) at m + i
            h, mtp_cache = mtp_forward_cached(
                params, h, d[:, None], cfg, KVCache(mtp_cache.layers, new_lengths + i), sharding=sharding
            )
    return KVCache(mtp_cache.layers, new_lengths), jnp.stack(drafts, 1), jnp.stack(dists, 1)


def draft_model(params: dict, cfg: ModelConfig, experts: int) -> tuple[dict, ModelConfig]:
    """The MTP modules made cheaper to run for drafting: each token's MoE block uses only its top
    `experts` routed experts (gate weights renormalised over them when model.norm_topk_prob, as
    the router does for its own k), and with experts = 0 only the shared expert(s), as a dense
    SwiGLU. The main model's entries are untouched (params are only re-keyed, nothing is copied).
    Any draft keeps the output distribution exact (only acceptance changes); this one reads
    (shared + experts) of the (shared + num_experts_per_tok) expert MLPs a full MTP block reads
    per token. experts must be in 0..num_experts_per_tok (0 only with shared experts)."""
    k = cfg.num_experts_per_tok
    if not cfg.num_experts or "moe" not in params["mtp"]["layer"]:
        raise ConfigError(f"draft experts={experts}: the MTP modules have no MoE block; use None")
    if not 0 <= experts <= k or (experts == 0 and not cfg.num_shared_experts):
        lo = 0 if cfg.num_shared_experts else 1
        raise ConfigError(
            f"draft experts={experts} must be in {lo}..model.num_experts_per_tok={k}"
            + ("" if lo == 0 else " (0, shared expert only, needs model.num_shared_experts >= 1)")
        )
    if experts == k:
        return params, cfg
    if experts:
        return params, dataclasses.replace(cfg, num_experts_per_tok=experts)
    layer = params["mtp"]["layer"]
    moe = layer["moe"]
    mlp = {"gate": moe["shared_gate"], "up": moe["shared_up"], "down": moe["shared_down"]}
    rest = {key: v for key, v in layer.items() if key != "moe"}
    return {**params, "mtp": {**params["mtp"], "layer": {**rest, "mlp": mlp}}}, cfg


def draft_head_columns(params: dict, cfg: ModelConfig, draft_vocab: jax.Array) -> jax.Array:
    """The shared output head's columns of the draft vocabulary: [embed, Vd] (computed once per
    weights, not per step)."""
    return jnp.take(output_head(params, cfg), draft_vocab, axis=1)


def _emitted(drafts: jax.Array, accepted: jax.Array, new: jax.Array) -> jax.Array:
    """int32[S, k+1]: drafts 1..a (the accepted ones), the new token at index a, zeros after.
    These are also the tokens after positions lengths..lengths+k of the verify window, which is
    what MTP module 1 takes next to them."""
    s, k = drafts.shape
    padded = jnp.concatenate([drafts, jnp.zeros((s, 1), drafts.dtype)], axis=1)
    step = jnp.arange(k + 1)[None, :]
    out = jnp.where(step == accepted[:, None], new[:, None], jnp.where(step < accepted[:, None], padded, 0))
    return out.astype(jnp.int32)

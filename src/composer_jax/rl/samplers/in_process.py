"""The in-process sampler backend: the continuous-batching sampler in the trainer's own process.

`TokenPolicy` is the token-level policy over an `AsyncSampler` (the project's chat template,
rl/samplers/base.py's records). `InProcessSamplers` is the backend: a new version's weights go to
the sampler between two decode steps (`update_weights`, at `publish`), so there is nothing left to
load; the policy version of each token is the one that sampled it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_jax.config import Config
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.inference.engine.asyncio_sampler import AsyncSampler
from composer_jax.inference.engine.batch_sampler import Sampler
from composer_jax.inference.engine.token_sampling import SamplingParams
from composer_jax.rl.samplers.base import Sampled, SamplerBackend, TokenSampler
from composer_jax.rl.samplers.policy import Policy, PolicyPool, SamplerUnavailable, TurnRequest


class TokenPolicy(TokenSampler):
    """The in-process sampler, through the chat format `tok` speaks."""

    def __init__(self, sampler: AsyncSampler, tok: Tokenizer):
        self.sampler, self.tok = sampler, tok
        self.max_context = sampler.sampler.max_len
        self.closed = False

    async def sample(self, tokens: list[int], req: TurnRequest) -> Sampled:
        if self.closed:
            raise SamplerUnavailable("the in-process sampler is closed")
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_tokens,
            seed=req.seed,
            stop_token_ids=self.chat.end_of_turn,
        )
        done = await self.sampler.generate(tokens, params)
        return Sampled(done.tokens, done.logprobs, done.versions, done.routing)


class InProcessSamplers(SamplerBackend):
    """The in-process backend (module docstring) over the samplers of `token_policies` (several may
    share one); rollouts run on `policies` (default: `token_policies`)."""

    def __init__(self, token_policies: Sequence[TokenPolicy], policies: Sequence[Policy] | None = None):
        self.token_policies = list(token_policies)
        self.policies = list(token_policies if policies is None else policies)
        self.samplers: list[AsyncSampler] = []
        for p in self.token_policies:
            if p.sampler not in self.samplers:
                self.samplers.append(p.sampler)

    async def publish(self, params: Any, version: int) -> None:
        for s in self.samplers:
            s.update_weights(params, version)

    async def load(self, version: int, pool: PolicyPool) -> None:
        del version, pool  # the sampler swaps the weights in itself, between two decode steps

    async def health(self) -> list[dict]:
        """Each sampler's version and decode steps (the keys of a serve replica's /health)."""
        return [
            {
                "engine": "in-process",
                "policy_version": s.version,
                "slots": s.sampler.slots,
                "steps": s.driver.steps,
                "slot_steps": s.driver.slot_steps,
                "step_s": s.driver.step_s,
                "swap_s": s.driver.swap_s,
            }
            for s in self.samplers
        ]

    async def profile_counters(self) -> dict[str, dict[str, float]]:
        """Each sampler's driver totals (engine step and prefill seconds, tokens), read directly; it
        tokenises nothing and speaks no HTTP (the chat format's tokens are the rollout side's)."""
        return {
            f"in-process/{i}": {
                "sampler_step_s": s.driver.step_s,
                "sampler_prefill_s": s.driver.prefill_s,
                "sampler_compile_s": s.driver.prefill_trace_s,
                "sampler_tokens": float(s.driver.tokens_generated),
            }
            for i, s in enumerate(self.samplers)
        }

    async def aclose(self) -> None:
        for p in self.token_policies:
            p.closed = True
        for s in self.samplers:
            await s.aclose()


def in_process_samplers(cfg: Config, params: Any, tok: Tokenizer, *, version: int, mesh, rules) -> InProcessSamplers:
    """The continuous-batching sampler of `rl.sampler` holding `params` as policy `version`, with
    one `TokenPolicy` on it."""
    inner = Sampler.from_config(
        params, cfg.model, cfg.rl.sampler, max_len=cfg.train.seq_len, version=version, mesh=mesh, rules=rules
    )
    return InProcessSamplers([TokenPolicy(AsyncSampler(inner), tok)])

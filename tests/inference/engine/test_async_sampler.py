"""`AsyncSampler`: the asyncio adapter over the engine's `Driver`. Concurrent coroutines get the
synchronous sampler's completions; its one failure policy: a refused request raises ValueError, a
failed step fails the requests in it and the rebuilt sampler (the weights before the swap that
failed) serves the next ones."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.inference.engine.asyncio_sampler import AsyncSampler
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.token_sampling import SamplingParams

CFG = cj.ModelConfig(num_layers=1, first_k_dense=0, num_mtp_layers=0, max_position_embeddings=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, n)]


def test_completions_refusals_and_a_failed_step_that_the_driver_survives():
    params = cj.init_params(CFG, jax.random.key(0))
    prompts = [_prompt(1, 5), _prompt(2, 7)]
    ref = Sampler(params, CFG, SamplerSettings(slots=2, max_len=16)).run([Request(p, GREEDY) for p in prompts])

    async def main():
        s = AsyncSampler(Sampler(params, CFG, SamplerSettings(slots=2, max_len=16), version=4))
        try:
            got = await asyncio.gather(*(s.generate(p, GREEDY) for p in prompts))
            for a, b in zip(got, ref, strict=True):
                assert a.tokens == b.tokens and a.versions == [4] * 3
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
            with pytest.raises(ValueError, match="exceeds the sampler's max_len=16"):
                await s.generate(_prompt(3, 15), GREEDY)
            first = s.sampler
            # weights the decode program cannot take: the step they first run in fails
            s.update_weights(jax.tree.map(lambda x: x[..., :1], params), 5)
            assert s.version == 5
            with pytest.raises(RuntimeError, match="the inference engine failed while this request ran"):
                await s.generate(prompts[0], GREEDY)
            assert s.sampler is not first and s.version == 4 and s.driver.failures == 1
            again = await s.generate(prompts[0], GREEDY)
            assert again.tokens == ref[0].tokens and again.versions == [4] * 3
        finally:
            await s.aclose()

    asyncio.run(main())

"""The one interface of a sampler backend, and the turn every token-level sampler shares.

A run samples its rollouts on one backend: the in-process continuous-batching sampler
(rl/samplers/in_process.py), `composer-jax serve` replicas (serve.py) or vLLM replicas (vllm.py).
`SamplerBackend` is all the rollout side (rl/rollout/side.py) knows of it: the policies rollouts
are spread over, and a policy version's life - `publish` (the new weights handed over), `load`
(every replica in rotation serves it), `health`, `aclose` - and a replica's way back into rotation
after a restart (`rejoin`, at the URL it now serves at: `follow`). The rollout side never asks
which backend it has.

`TokenSampler` is a policy of any of them: the checkpoint's chat format (formats/chat_format.py)
over one sampler, with the
`Generation` records (the model's own tokens verbatim, loss mask, log-probabilities, per-token
versions, routed experts). A backend only says how one turn's tokens are sampled (`sample`); the
records are kept here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from composer_jax.formats.chat_format import ChatFormat, chat_format
from composer_jax.formats.chatml import AssistantTurn
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.rl.samplers.policy import Generation, Policy, PolicyPool, SamplerUnavailable, TurnRequest


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One turn's sample: tokens int32[n] (the stop token included), logprobs[n] (under the
    distribution each token was drawn from), versions[n] (the policy version that sampled each), and
    routing int32[prompt + n - 1, moe_layers, k] (the experts of every position a forward saw) or
    None (dense models, or no router replay)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: np.ndarray | None = None


class TokenSampler(ABC):
    """A token-level policy (`rl.samplers.policy.Policy`): the chat format's tokens, with the
    records of tokens no sampler generated, and the records of a sampled turn. Subclasses set `tok`
    and `max_context` (and `chat`, where it is not the one `tok` speaks) and implement `sample`."""

    tok: Tokenizer
    max_context: int  # the most tokens one generation may hold (prompt + generated)
    _chat: ChatFormat | None = None

    @property
    def chat(self) -> ChatFormat:
        """The conversation format the policy prompts in and reads turns back with."""
        if self._chat is None:
            self._chat = chat_format(self.tok)
        return self._chat

    @chat.setter
    def chat(self, fmt: ChatFormat) -> None:
        self._chat = fmt

    @abstractmethod
    async def sample(self, tokens: list[int], req: TurnRequest) -> Sampled:
        """The next assistant turn after the context `tokens`, stopping at the chat format's end of
        turn only; SamplerUnavailable when the sampler cannot serve, ValueError for a request it refuses."""

    def begin(self, messages: list[dict], tools: Sequence[dict] | None = None) -> Generation:
        ids = self.chat.prompt(messages, tools=tools if self.chat.native_tools else None).tolist()
        return Generation(list(messages), ids, [0.0] * len(ids), [0.0] * len(ids), [-1] * len(ids))

    def extend(self, gen: Generation, messages: list[dict]) -> None:
        ids = self.chat.continuation(messages).tolist()
        gen.messages.extend(messages)
        gen.tokens += ids
        gen.loss_mask += [0.0] * len(ids)
        gen.logprobs += [0.0] * len(ids)
        gen.versions += [-1] * len(ids)
        if gen.routing is not None:  # no forward has routed these yet: the next turn's prefill will
            gen.routing = np.concatenate([gen.routing, np.repeat(gen.routing[-1:], len(ids), axis=0)], axis=0)

    async def turn(self, gen: Generation, req: TurnRequest) -> AssistantTurn:
        done = await self.sample(gen.tokens, req)
        gen.tokens += done.tokens
        gen.loss_mask += [1.0] * len(done.tokens)
        gen.logprobs += done.logprobs
        gen.versions += done.versions
        gen.generated += len(done.tokens)
        if done.routing is not None:  # covers every position but the last generated token
            gen.routing = np.concatenate([done.routing, done.routing[-1:]], axis=0)
        turn = self.chat.parse(done.tokens, call_id_prefix=f"call_{len(gen.messages)}")
        gen.messages.append(turn.message())
        return turn


class SamplerBackend(ABC):
    """The samplers of a run (module docstring). `policies`: what rollouts run on, in turn
    (`PolicyPool`); the backend keeps them serving the newest version it was given."""

    policies: list[Policy]
    # whether a version load still in flight at close is cancelled (a vLLM replica's restart, which
    # nothing will sample from any more) rather than awaited
    cancel_loads_at_close: ClassVar[bool] = False

    @abstractmethod
    async def publish(self, params: Any, version: int) -> None:
        """Policy `version`'s weights (`params`, laid out as `param_specs(model)`), handed to the
        backend before any replica loads it. The learner has written them to its weight store first."""

    @abstractmethod
    async def load(self, version: int, pool: PolicyPool) -> None:
        """Every policy in `pool`'s rotation serves `version` from its next decode step on; one
        that cannot (`SamplerUnavailable`) is taken out of the rotation."""

    @abstractmethod
    async def health(self) -> list[dict]:
        """Each sampler's state (policy version, decode steps, slot occupancy), those that answer."""

    @abstractmethod
    async def aclose(self) -> None:
        """The samplers and their connections closed (idempotent); a later turn raises
        SamplerUnavailable."""

    async def profile_counters(self) -> dict[str, dict[str, float]]:
        """Each sampler's cumulative counters for the run's profile (runtime/profile.py: engine step,
        prefill, tokenising and HTTP seconds), by sampler; {} where the backend keeps none that the
        profile reads (vLLM)."""
        return {}

    async def rejoin(self, policy: Policy, version: int, health_timeout_s: float = 5.0) -> None:
        """Make `policy` (out of rotation) ready to rejoin it: it answers /health (within
        `health_timeout_s`) and serves `version`; SamplerUnavailable when it cannot. The in-process
        sampler's policies never leave the rotation but closed, so they never come back."""
        raise SamplerUnavailable(f"{policy!r}: the {type(self).__name__} backend's samplers do not come back")

    def follow(self, index: int, url: str) -> None:
        """Sampler `index` (of `policies`) serves at `url` now: its supervisor restarted it on
        another port. Only replicas in other processes move."""
        del index, url


class Replica(Policy, Protocol):
    """A sampler in another process: a policy holding its own connection."""

    closed: bool
    base_url: str

    async def health(self) -> dict: ...

    async def load_version(self, version: int, store_url: str | None = None) -> int: ...

    async def aclose(self) -> None: ...


class ReplicaBackend(SamplerBackend):
    """A backend of replicas in other processes (serve, vLLM): `replicas` are its policies."""

    replicas: Sequence[Replica]
    store_url: str | None = None  # the weight store the replicas load versions from (serve replicas)

    async def rejoin(self, policy: Policy, version: int, health_timeout_s: float = 5.0) -> None:
        """The replica answers /health, then loads `version` (a serve replica from the weight store,
        a vLLM one by a restart on the version's export) unless it serves it or a newer one already:
        a rejoined replica samples the current version from its first turn on (and every token
        carries the version that sampled it, so the queue's staleness bound holds either way)."""
        replica = next((r for r in self.replicas if r is policy), None)
        if replica is None:
            raise SamplerUnavailable(f"{policy!r} is not one of this backend's replicas")
        try:
            await asyncio.wait_for(replica.health(), health_timeout_s)
        except TimeoutError:
            raise SamplerUnavailable(f"{policy!r}: /health did not answer within {health_timeout_s:g} s") from None
        await replica.load_version(version, self.store_url)

    def follow(self, index: int, url: str) -> None:
        self.replicas[index].base_url = url.rstrip("/")

    async def health(self) -> list[dict]:
        out = []
        for p in self.replicas:
            with contextlib.suppress(SamplerUnavailable):
                out.append(await p.health())
        return out

    @staticmethod
    async def load_or_remove(pool: PolicyPool, replica: Policy, load: Awaitable[Any]) -> None:
        """Await `replica`'s version load; a replica that cannot load is taken out of `pool`'s rotation."""
        try:
            await load
        except SamplerUnavailable as exc:
            pool.remove(replica, str(exc))

    async def aclose(self) -> None:
        for p in self.replicas:
            if not p.closed:
                await p.aclose()

"""The policy an agent talks to: a token-level sampler (rl/samplers/base.py's `TokenSampler`: the
in-process sampler, a serve or a vLLM replica) or an OpenAI-compatible endpoint.

Both keep one *generation* (a context that grows turn by turn) and answer the agent loop's three
questions: start a generation from messages, sample the next assistant turn, append what the
environment said. A token policy keeps the model's own tokens verbatim (the trainer trains on
exactly what was sampled: re-tokenising the text could split it differently) with, per generated
token, its sampler log-probability, policy version and the experts it was routed to. The endpoint
policy works on messages and records no tokens: its rollouts are for evaluation, not training.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np

from composer_jax.env.api.protocol import BASE_TOOL_NAMES, tool_schemas
from composer_jax.formats.chatml import AssistantTurn

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class Generation:
    """One context of a rollout. messages: the OpenAI messages so far (for trajectories).

    Token policy only (empty for the endpoint policy): tokens int32[n] of the whole context;
    loss_mask[n] 1.0 where the policy generated the token; logprobs[n] and versions[n] the sampler's
    log-probability and policy version of generated tokens (0.0 / -1 elsewhere); routing
    int32[n, moe_layers, k] the experts of every position from the latest forward over it; positions
    no forward has seen yet (the last generated token, observations after the last turn) repeat the
    row before them: they only affect their own outputs, which train nothing. None for dense models."""

    messages: list[dict]
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routing: np.ndarray | None = None
    generated: int = 0  # tokens the policy generated in this context

    def context_len(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class SamplerUnavailable(RuntimeError):
    """The policy's sampler cannot serve (a dead or unreachable sampler process, a closed engine).
    The rollout in flight is not scored: the caller redoes it on another sampler."""


class Policy(Protocol):
    max_context: int  # the most tokens one generation may hold (prompt + generated)

    def begin(self, messages: list[dict], tools: Sequence[dict] | None = None) -> Generation:
        """A generation of `messages` (the system prompt and the task); `tools`: the session's tool
        schemas (OpenAI function tools), which the policy gives the model as its format takes them."""
        ...

    async def turn(self, gen: Generation, req: TurnRequest) -> AssistantTurn: ...

    def extend(self, gen: Generation, messages: list[dict]) -> None: ...


class OpenAIPolicy:
    """Any OpenAI-compatible /v1/chat/completions endpoint (for evaluation: no token records).

    Through the `openai` SDK's AsyncOpenAI, which retries connection errors, 408, 409, 429 and 5xx
    answers up to `max_retries` times with exponential backoff, waiting what a `Retry-After`
    header says when there is one (up to two minutes), so an evaluation against a hosted endpoint
    survives rate limits. `timeout_s` bounds each attempt. An answer still failing after the
    retries raises RuntimeError with the endpoint, status and body."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "",
        max_context: int = 32768,
        tools: Sequence[dict] = tuple(tool_schemas(BASE_TOOL_NAMES)),  # every session's; not the web tools
        timeout_s: float = 600.0,
        max_retries: int = 5,
        client: openai.AsyncOpenAI | None = None,
    ):
        import openai  # the `eval` extra: only endpoint evaluations need it

        self.base_url, self.model, self.max_context, self.tools = base_url.rstrip("/"), model, max_context, list(tools)
        # the SDK needs a key; endpoints without one ignore the placeholder
        self.client = client or openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout_s, max_retries=max_retries
        )

    def begin(self, messages: list[dict], tools: Sequence[dict] | None = None) -> Generation:
        return Generation(list(messages))  # the endpoint gets `self.tools` with every request

    def extend(self, gen: Generation, messages: list[dict]) -> None:
        gen.messages.extend(messages)

    async def turn(self, gen: Generation, req: TurnRequest) -> AssistantTurn:
        data = await self._complete(gen.messages, req)
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        calls, malformed = _endpoint_tool_calls(msg.get("tool_calls") or [], f"call_{len(gen.messages)}")
        usage = data.get("usage") or {}
        gen.generated += int(usage.get("completion_tokens") or 0)
        turn = AssistantTurn(msg.get("content") or "", calls, malformed, choice.get("finish_reason") != "length")
        gen.messages.append(turn.message())
        return turn

    async def _complete(self, messages: list[dict], req: TurnRequest) -> dict:
        """One chat completion (retried by the SDK) -> the response as JSON."""
        import openai

        try:
            resp = await self.client.chat.completions.create(
                model=self.model,
                messages=cast(Any, messages),
                tools=cast(Any, self.tools),
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
            )
        except openai.APIStatusError as e:
            raise RuntimeError(
                f"policy endpoint {self.base_url}: HTTP {e.status_code}: {e.response.text[:500]}"
            ) from None
        return resp.to_dict()

    async def aclose(self) -> None:
        await self.client.close()


def _endpoint_tool_calls(raw: list[Any], id_prefix: str) -> tuple[list[dict], list[str]]:
    """An endpoint's message.tool_calls -> (OpenAI function calls, why each other entry was dropped);
    calls without an id get f"{id_prefix}_{i}"."""
    calls, malformed = [], []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            args = fn.get("arguments", "{}")
            calls.append(
                {
                    "id": call.get("id") or f"{id_prefix}_{i}",
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
                }
            )
        else:
            malformed.append(f"tool call {i}: not an OpenAI function call: {call!r:.200}")
    return calls, malformed


class PolicyPool:
    """The policies rollouts run on, in turn. One that raised `SamplerUnavailable` is taken *out* of
    rotation with its reason (`out`, and the history `lost`) and may come back with `rejoin`: the
    rollout side (rl/rollout/rejoin.py) rejoins a replica once its supervisor reports it up again,
    it answers /health and it serves the current policy version.

    While no policy is in rotation, `run` waits up to `rejoin_timeout_s` seconds for one to rejoin
    (0: it does not wait), then raises RuntimeError naming each policy out and why."""

    def __init__(self, policies: Sequence[Policy], *, rejoin_timeout_s: float = 0.0):
        if not policies:
            raise ValueError("no policies to sample with; give at least one sampler")
        if isinstance(rejoin_timeout_s, bool) or not isinstance(rejoin_timeout_s, int | float) or rejoin_timeout_s < 0:
            raise ValueError(f"rejoin_timeout_s={rejoin_timeout_s!r}; accepted: seconds >= 0 (0: no wait)")
        self.policies = list(policies)
        self.alive = list(policies)
        self.out: list[tuple[Policy, str]] = []  # out of rotation now, with the reason
        self.lost: list[tuple[Policy, str]] = []  # every removal, in order
        self.rejoined = 0  # rejoins so far
        self.rejoin_timeout_s = float(rejoin_timeout_s)
        self._turn = 0
        self._back: asyncio.Event | None = None  # set by `rejoin` (made in the running loop)
        self._notes: dict[int, str] = {}  # id(policy) -> what was learnt of it since it went out

    def pick(self) -> Policy:
        if not self.alive:
            raise RuntimeError(f"every sampler is unavailable ({len(self.out)} out: {self._reasons()})")
        p = self.alive[self._turn % len(self.alive)]
        self._turn += 1
        return p

    def _reasons(self) -> str:
        return (
            "; ".join(
                f"{p!r}: {why}" + (f" ({self._notes[id(p)]})" if id(p) in self._notes else "") for p, why in self.out
            )
            or "none out"
        )

    def note(self, policy: Policy, what: str) -> None:
        """What was learnt of `policy` while it is out (its supervisor's word, a failed rejoin): named
        with its reason in the errors of a pool with no policy in rotation."""
        if self.is_out(policy):
            self._notes[id(policy)] = what

    def remove(self, policy: Policy, why: str) -> None:
        if policy in self.alive:
            self.alive.remove(policy)
            self.out.append((policy, why))
            self.lost.append((policy, why))
            log.warning("sampler %r taken out of rotation: %s (%d left)", policy, why, len(self.alive))

    def is_out(self, policy: Policy) -> bool:
        return any(p is policy for p, _ in self.out)

    def rejoin(self, policy: Policy) -> None:
        """`policy` (out of rotation) is back in it; rollouts waiting for a policy go on."""
        if not self.is_out(policy):
            return
        self.out = [(p, why) for p, why in self.out if p is not policy]
        self._notes.pop(id(policy), None)
        self.alive.append(policy)
        self.rejoined += 1
        log.warning("sampler %r rejoined the rotation (%d in it)", policy, len(self.alive))
        if self._back is not None:
            self._back.set()

    def metrics(self) -> dict[str, float]:
        """`samplers/in_rotation`, `samplers/out` (now), `samplers/removed` and `samplers/rejoined` (so far)."""
        return {
            "samplers/in_rotation": float(len(self.alive)),
            "samplers/out": float(len(self.out)),
            "samplers/removed": float(len(self.lost)),
            "samplers/rejoined": float(self.rejoined),
        }

    async def wait_in_rotation(self) -> None:
        """Return once some policy is in rotation; RuntimeError after `rejoin_timeout_s` without one."""
        if self.alive:
            return
        if not self.rejoin_timeout_s:
            self.pick()  # raises, naming each policy out and why
        deadline = time.monotonic() + self.rejoin_timeout_s
        if self._back is None:
            self._back = asyncio.Event()
        while not self.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"every sampler is unavailable and none rejoined within rl.supervision.rejoin_timeout_s="
                    f"{self.rejoin_timeout_s:g} s ({len(self.out)} out: {self._reasons()})"
                )
            self._back.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._back.wait(), left)

    async def run(self, fn: Callable[[Policy], Awaitable[T]]) -> T:
        """`fn(policy)` on the next policy; redone on another while policies raise SamplerUnavailable
        (waiting for a rejoin while none is in rotation: `wait_in_rotation`)."""
        while True:
            await self.wait_in_rotation()
            policy = self.pick()
            try:
                return await fn(policy)
            except SamplerUnavailable as exc:
                self.remove(policy, str(exc) or type(exc).__name__)

"""The agent loop: one rollout of a policy against an environment server session.

A rollout is a conversation: the system prompt (naming the session's tools), the task, then
assistant turns. Every tool call of a turn is checked against the protocol's schemas here; the
valid ones run on the server in parallel (one request), and every call, valid or not, gets a tool
message back: a model's bad call (not JSON, unknown tool, wrong arguments, past the per-turn cap)
is an observation the model sees and a count the reward can use, never a protocol error. The
rollout ends when the model answers without a tool call, a budget ends (turns, tokens, context),
and is then graded by the environment.

Self-summarisation: before a turn that would push a generation's context past
`agent.context_budget`, the model is asked for a summary of its progress; a new generation starts
from the task and that summary. All generations of a rollout share its final reward.

Environment failures (the server dies, the session is lost, no server accepts) restart the rollout
from scratch on another server (`agent.env_retries` times): a rollout is scored by its task, not by
the infrastructure. Policy failures propagate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

from composer_jax.config.agent import AgentConfig
from composer_jax.env.api.client import EnvClient, EnvClientError, RemoteSession, RequestRejected
from composer_jax.env.api.protocol import ToolArgumentError, parse_call, schema_names, system_prompt, tool_message
from composer_jax.formats.chatml import AssistantTurn
from composer_jax.rl.samplers.policy import Generation, Policy, TurnRequest

# context tokens kept free past the budget for the summary request message (its template tokens and
# text; the default request is ~60 tokens with the shipped tokenizer)
SUMMARY_REQUEST_ROOM = 128
MIN_SUMMARY_TOKENS = 16  # below this, a summary would say nothing: the rollout ends instead


class RolloutFailed(RuntimeError):
    """The environment failed on every attempt; the rollout has no score."""


@dataclasses.dataclass
class Rollout:
    """A finished, graded rollout.

    generations: the contexts in order (more than one after self-summarisation).
    finish_reason: "answer" (the model answered without a tool call), "turns", "tokens" (the
    rollout's token budget), "length" (a turn hit max_turn_tokens mid-answer), "context" (full with
    no summaries left). grade: the environment's grade (reward, tests, diff, ...)."""

    task_id: str
    seed: int
    generations: list[Generation]
    finish_reason: str
    grade: dict
    turns: int = 0
    tool_calls: int = 0  # calls the model made (valid or not)
    broken_tool_calls: int = 0  # malformed, invalid, unknown-tool or over-the-cap calls
    parallel_tool_turns: int = 0  # turns with more than one valid call
    summaries: int = 0
    env_retries: int = 0
    server: str = ""
    # seconds of the graded attempt: waiting for the policy's turns (sampler HTTP round trip, its
    # queue, prefill and decode), for the environment (session, tool runs, grading), and in all
    policy_s: float = 0.0
    env_s: float = 0.0
    wall_s: float = 0.0

    @property
    def generated_tokens(self) -> int:
        return sum(g.generated for g in self.generations)

    @property
    def tampered(self) -> bool:
        """The grade names files with which the workspace tampered with grading (the environment's
        `tampering` list: a planted conftest, startup hook, runner stand-in, forged reward)."""
        return bool(self.grade.get("tampering"))

    @property
    def env_reward(self) -> float:
        """The grade's reward; 0 for a rollout that tampered with grading, whatever the grade says."""
        return 0.0 if self.tampered else float(self.grade.get("reward", 0.0))

    def trajectory(self) -> dict[str, Any]:
        """JSON-ready record: the OpenAI messages of every generation and the counts."""
        return {
            "task_id": self.task_id,
            "seed": self.seed,
            "finish_reason": self.finish_reason,
            "reward": self.env_reward,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "broken_tool_calls": self.broken_tool_calls,
            "parallel_tool_turns": self.parallel_tool_turns,
            "summaries": self.summaries,
            "generated_tokens": self.generated_tokens,
            "env_retries": self.env_retries,
            "generations": [g.messages for g in self.generations],
            "diff": self.grade.get("diff", ""),
        }


def turn_seed(seed: int, generation: int, turn: int) -> int:
    """A 32-bit sampling seed per (rollout seed, generation, turn), stable across processes."""
    digest = hashlib.blake2b(f"{seed}/{generation}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _cut(text: str, limit: int) -> str:
    if limit and len(text) > limit:
        return text[:limit] + f"\n[... cut: {len(text) - limit} more characters]"
    return text


@dataclasses.dataclass
class _Counts:
    turns: int = 0
    tool_calls: int = 0
    broken: int = 0
    parallel: int = 0
    summaries: int = 0


class _Episode:
    def __init__(self, policy: Policy, session: RemoteSession, cfg: AgentConfig, seed: int):
        self.policy, self.session, self.cfg, self.seed = policy, session, cfg, seed
        self.counts = _Counts()
        self.generations: list[Generation] = []
        self.policy_s = self.env_s = 0.0  # seconds awaiting the policy's turns / the tool runs
        # the tools this session offers (the server's create response): the system prompt names
        # exactly these, and a call to another is an unknown tool the model is told about
        self.tool_names = schema_names(session.tools)

    async def _turn(self, gen: Generation, request: TurnRequest) -> AssistantTurn:
        t0 = time.perf_counter()
        try:
            return await self.policy.turn(gen, request)
        finally:
            self.policy_s += time.perf_counter() - t0

    def _request(self, max_tokens: int) -> TurnRequest:
        cfg = self.cfg
        seed = turn_seed(self.seed, len(self.generations) - 1, self.counts.turns)
        return TurnRequest(max_tokens, seed, cfg.temperature, cfg.top_p, cfg.top_k)

    def _opening(self, summary: str | None = None) -> list[dict]:
        task = self.session.instruction
        if summary is not None:
            task += "\n\nYou already worked on this task; your summary of that work:\n" + summary
        return [
            {"role": "system", "content": self.cfg.system_prompt or system_prompt(self.tool_names)},
            {"role": "user", "content": task},
        ]

    async def run(self) -> str:
        cfg, counts = self.cfg, self.counts
        gen = self.policy.begin(self._opening(), tools=self.session.tools)
        self.generations.append(gen)
        limit = self.policy.max_context
        if cfg.context_budget:  # the summary request and the summary must still fit after it
            limit = min(cfg.context_budget, limit - cfg.summary_tokens - SUMMARY_REQUEST_ROOM)
        while True:
            generated = sum(g.generated for g in self.generations)
            if counts.turns >= cfg.max_turns:
                return "turns"
            if generated >= cfg.max_rollout_tokens:
                return "tokens"
            room = min(cfg.max_turn_tokens, cfg.max_rollout_tokens - generated)
            if gen.context_len() + room > limit:
                if not cfg.summarise or counts.summaries >= cfg.max_summaries:
                    return "context"
                summarised = await self._summarise(gen)
                if summarised is None:
                    return "context"
                gen = summarised
                continue
            turn = await self._turn(gen, self._request(room))
            counts.turns += 1
            n_calls = len(turn.tool_calls) + len(turn.malformed)
            counts.tool_calls += n_calls
            if not turn.finished:
                counts.broken += len(turn.malformed)
                return "length"
            if n_calls == 0:
                return "answer"
            self.policy.extend(gen, await self._observe(turn.tool_calls, turn.malformed))

    async def _observe(self, calls: list[dict], malformed: list[str]) -> list[dict]:
        """Tool messages answering one turn's calls, in call order, malformed ones last."""
        cfg, counts = self.cfg, self.counts
        answers: dict[int, dict] = {}
        valid: list[tuple[int, dict]] = []
        for i, call in enumerate(calls):
            fn = call["function"]
            if len(valid) >= cfg.max_tool_calls_per_turn:
                answers[i] = tool_message(
                    call["id"], error=f"not run: at most {cfg.max_tool_calls_per_turn} tool calls per turn"
                )
                continue
            try:
                name, args = parse_call(fn["name"], fn["arguments"], offered=self.tool_names)
            except ToolArgumentError as exc:
                answers[i] = tool_message(call["id"], error=str(exc))
                continue
            valid.append((i, {"id": call["id"], "name": name, "arguments": args}))
        counts.broken += len(calls) - len(valid) + len(malformed)
        if len(valid) > 1:
            counts.parallel += 1
        if valid:
            t0 = time.perf_counter()
            try:
                results = await self.session.call_tools([c for _, c in valid])
            except RequestRejected as exc:  # checked above, so a server that disagrees: say so, keep going
                results = [{"ok": False, "error": f"the environment refused the calls: {exc}"}] * len(valid)
            finally:
                self.env_s += time.perf_counter() - t0
            for (i, call), res in zip(valid, results):
                if res.get("ok"):
                    body = json.dumps(res.get("result"), ensure_ascii=False)
                    answers[i] = {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": _cut(body, cfg.max_observation_chars),
                    }
                else:
                    answers[i] = tool_message(call["id"], error=_cut(str(res.get("error")), cfg.max_observation_chars))
        out = [answers[i] for i in range(len(calls))]
        n = len(self.generations[-1].messages)
        out += [tool_message(f"malformed_{n}_{j}", error=m) for j, m in enumerate(malformed)]
        return out

    async def _summarise(self, gen: Generation) -> Generation | None:
        """The summary turn and the generation that starts from it; None when even the summary
        request no longer fits (observations filled the context): the rollout then ends."""
        self.policy.extend(gen, [{"role": "user", "content": self.cfg.summary_prompt}])
        room = min(self.cfg.summary_tokens, self.policy.max_context - gen.context_len())
        if room < MIN_SUMMARY_TOKENS:
            return None
        turn = await self._turn(gen, self._request(room))
        self.counts.turns += 1
        self.counts.summaries += 1
        new = self.policy.begin(self._opening(turn.content.strip()), tools=self.session.tools)
        self.generations.append(new)
        return new


async def run_rollout(
    policy: Policy, client: EnvClient, task_id: str, cfg: AgentConfig, *, seed: int = 0, env_seed: int | None = None
) -> Rollout:
    """Run and grade one rollout of `task_id` (env_seed: the task's seed for generated families).

    Raises RolloutFailed when every attempt lost its environment."""
    errors: list[str] = []
    for attempt in range(cfg.env_retries + 1):
        session: RemoteSession | None = None
        t0 = time.perf_counter()
        try:
            session = await client.create_session(task_id, seed=env_seed)
            setup_s = time.perf_counter() - t0
            episode = _Episode(policy, session, cfg, seed)
            finish = await episode.run()
            t1 = time.perf_counter()
            grade = await session.grade()
            grade_s = time.perf_counter() - t1
        except EnvClientError as exc:
            if isinstance(exc, RequestRejected) and exc.status < 500 and exc.status != 429:
                raise  # a bad request (unknown task...) fails the same way everywhere
            errors.append(f"attempt {attempt}: {exc}")
            continue
        finally:
            if session is not None:
                try:
                    await session.close()
                except EnvClientError:
                    pass
        c = episode.counts
        return Rollout(
            task_id,
            seed,
            episode.generations,
            finish,
            grade,
            c.turns,
            c.tool_calls,
            c.broken,
            c.parallel,
            c.summaries,
            attempt,
            session.server_url,
            policy_s=episode.policy_s,
            env_s=setup_s + episode.env_s + grade_s,
            wall_s=time.perf_counter() - t0,
        )
    raise RolloutFailed(f"task {task_id!r}: the environment failed on all {cfg.env_retries + 1} attempts: {errors}")

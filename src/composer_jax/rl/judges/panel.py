"""The judges of `rl.reward.judges` asked for verdicts on a group's rollouts.

`JudgePanel.judge(rollouts)` returns, per rollout, one `JudgedTerm` per judge (rl/algo/rewards.py),
which `with_judged` adds to the rollout's reward. Per judge and rollout, in this order:

- no final message (a budget ended the rollout): outcome `no_message`, neutral, no request;
- the rubric's rule fires (unsupported claims: "the tests pass" and no test ran...): outcome `rule`,
  the full penalty (score 1), no request;
- no endpoint (a ruled rubric run by its rule alone): `no_judge`, neutral;
- the verdict is in the cache (same rubric, version, model and rendered inputs; rollouts of one
  batch with the same inputs share one request): `verdict`, `cached`;
- else one chat-completions request to the judge's endpoint. All of a batch's requests, over its
  judges, are in flight together, at most `concurrency` per judge over every batch at once; they
  share a deadline of `timeout_s` from the batch's start (a group's judging is bounded however many
  requests queue). Not answered by then: `timeout`; refused or failed (HTTP status, connection, a
  body that is no chat completion): `error`; an answer without a `SCORE: x` line (x in [0, 1]):
  `unparsable`. All three are neutral (the term is 0) and counted, never raised: a judge that is
  down or confused costs its terms, not the run.

Requests use temperature 0 and the project's HTTP client (httpx); the key, when the judge has one,
is read from the environment variable `api_key_env` names, when the panel is built.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from composer_jax.config.rl import JudgeConfig
from composer_jax.errors import ConfigError
from composer_jax.rl.algo.rewards import JudgedTerm
from composer_jax.rl.judges.rubrics import RUBRICS, FinishedRollout, JudgeInputs, Rubric, inputs_of, parse_verdict

log = logging.getLogger(__name__)


def cache_key(rubric: Rubric, model: str, messages: list[dict[str, str]]) -> str:
    """sha256 of (rubric name, rubric version, judge model, the rendered messages: the inputs)."""
    blob = json.dumps([rubric.name, rubric.version, model, messages], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def completion_text(body: Any) -> str:
    """The first choice's message content of an OpenAI chat-completion body; ValueError when the
    body is not one (a reasoning model's `reasoning_content` is not the verdict and is ignored)."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"not a chat completion: {str(body)[:200]!r}") from exc
    if content is not None and not isinstance(content, str):
        raise ValueError(f"a chat completion whose content is not text: {content!r}")
    return content or ""


class VerdictCache:
    """Scores by `cache_key`, the least recently used dropped past `size` (0: nothing kept)."""

    def __init__(self, size: int):
        self.size = size
        self._scores: collections.OrderedDict[str, float] = collections.OrderedDict()

    def get(self, key: str) -> float | None:
        score = self._scores.get(key)
        if score is not None:
            self._scores.move_to_end(key)
        return score

    def put(self, key: str, score: float) -> None:
        if self.size <= 0:
            return
        self._scores[key] = score
        self._scores.move_to_end(key)
        while len(self._scores) > self.size:
            self._scores.popitem(last=False)

    def __len__(self) -> int:
        return len(self._scores)


class Judge:
    """One `rl.reward.judges` entry: its rubric, key, cache and concurrency bound."""

    def __init__(self, cfg: JudgeConfig, key: str):
        self.cfg, self.rubric, self.key = cfg, RUBRICS[cfg.rubric], key
        self.cache = VerdictCache(cfg.cache_size)
        self.requests = 0  # requests sent (for tests and logs)
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # one bound per event loop
            self._slots = (loop, asyncio.Semaphore(self.cfg.concurrency))
        return self._slots[1]

    def _term(self, outcome: str, score: float | None = None, cached: bool = False) -> JudgedTerm:
        value = self.rubric.value(score, self.cfg.weight) + 0.0 if score is not None else 0.0
        return JudgedTerm(self.rubric.name, self.rubric.version, value, outcome, score, cached)

    async def batch(self, client: httpx.AsyncClient, inputs: Sequence[JudgeInputs]) -> list[JudgedTerm]:
        """One term per input (the module docstring's order)."""
        deadline = asyncio.get_running_loop().time() + self.cfg.timeout_s
        terms: list[JudgedTerm | None] = [None] * len(inputs)
        wanted: dict[str, tuple[list[dict[str, str]], list[int]]] = {}
        for i, x in enumerate(inputs):
            if x.final_message is None:
                terms[i] = self._term("no_message")
            elif self.rubric.rule is not None and (reason := self.rubric.rule(x)) is not None:
                log.debug("judge %s: rule: %s", self.rubric.name, reason)
                terms[i] = self._term("rule", 1.0)
            elif not self.cfg.endpoint:
                terms[i] = self._term("no_judge")
            else:
                messages = self.rubric.render(x, self.cfg.max_input_chars)
                key = cache_key(self.rubric, self.cfg.model, messages)
                score = self.cache.get(key)
                if score is not None:
                    terms[i] = self._term("verdict", score, cached=True)
                else:
                    wanted.setdefault(key, (messages, []))[1].append(i)
        keys = list(wanted)
        answers = await asyncio.gather(*(self._ask(client, wanted[k][0], deadline) for k in keys))
        for key, (outcome, score) in zip(keys, answers):
            if score is not None:
                self.cache.put(key, score)
            for n, i in enumerate(wanted[key][1]):
                terms[i] = self._term(outcome, score, cached=n > 0 and score is not None)
        return [t for t in terms if t is not None]

    async def _ask(
        self, client: httpx.AsyncClient, messages: list[dict[str, str]], deadline: float
    ) -> tuple[str, float | None]:
        """(outcome, score) of one request, never raising for the judge's faults."""
        cfg = self.cfg
        body = {
            "model": cfg.model,
            "messages": messages,
            "max_tokens": cfg.max_tokens,
            "temperature": 0.0,
        }
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            async with asyncio.timeout_at(deadline):
                async with self._semaphore():
                    self.requests += 1
                    resp = await client.post(cfg.endpoint.rstrip("/") + "/chat/completions", json=body, headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            return "timeout", None
        except httpx.HTTPError as exc:
            log.warning("judge %s at %s: %s", self.rubric.name, cfg.endpoint, exc)
            return "error", None
        if resp.status_code != 200:
            log.warning("judge %s at %s: HTTP %d %s", self.rubric.name, cfg.endpoint, resp.status_code, resp.text[:300])
            return "error", None
        try:
            text = completion_text(resp.json())
        except ValueError as exc:
            log.warning("judge %s at %s: %s", self.rubric.name, cfg.endpoint, exc)
            return "error", None
        score = parse_verdict(text)
        if score is None:
            log.debug("judge %s: unparsable verdict %r", self.rubric.name, text[-300:])
            return "unparsable", None
        return "verdict", score


def judge_keys(judges: Sequence[JudgeConfig], environ: Mapping[str, str]) -> list[str]:
    """Each judge's bearer key from the variable its api_key_env names ("" without one); a
    ConfigError names a variable that is unset or empty."""
    keys = []
    for i, c in enumerate(judges):
        key = environ.get(c.api_key_env, "") if c.api_key_env else ""
        if c.api_key_env and c.endpoint and not key:
            raise ConfigError(
                f"rl.reward.judges[{i}].api_key_env={c.api_key_env!r}: that environment variable is unset or empty; "
                f"set it to the key of {c.endpoint}, or give api_key_env: '' for an endpoint that needs none"
            )
        keys.append(key)
    return keys


class JudgePanel:
    """The run's judges (module docstring); `aclose` closes its HTTP connections. `transport`: an
    httpx transport to use instead of the network (tests)."""

    def __init__(
        self,
        judges: Sequence[JudgeConfig],
        *,
        environ: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        keys = judge_keys(judges, os.environ if environ is None else environ)
        self.judges = [Judge(c, k) for c, k in zip(judges, keys)]
        # the deadline is the panel's own (asyncio.timeout_at); httpx's only bounds a stuck connect
        self._client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(None, connect=30.0))

    def versions(self) -> dict[str, int]:
        """Each judge's rubric version, by rubric name."""
        return {j.rubric.name: j.rubric.version for j in self.judges}

    async def judge(self, rollouts: Sequence[FinishedRollout]) -> list[tuple[JudgedTerm, ...]]:
        """Per rollout, its terms in `rl.reward.judges` order (all judges and rollouts at once)."""
        inputs = [inputs_of(r) for r in rollouts]
        return await self.judge_inputs(inputs)

    async def judge_inputs(self, inputs: Sequence[JudgeInputs]) -> list[tuple[JudgedTerm, ...]]:
        per_judge = await asyncio.gather(*(j.batch(self._client, inputs) for j in self.judges))
        return [tuple(col[i] for col in per_judge) for i in range(len(inputs))]

    async def aclose(self) -> None:
        await self._client.aclose()

"""On-policy distillation's teacher (`rl.loss.objective: distill`, `rl.distill`): the student samples,
the teacher scores the sampled tokens, and each policy token's advantage becomes

    A_t = task_weight * A_task + weight * (log teacher(t) - log student(t))

(`rl/algo/advantages.py`'s `distill_advantages`, applied by `build_batch`), the recipe of on-policy
distillation as prime-rl and Thinking Machines publish it: log teacher - log student is minus the
per-token estimate of the reverse KL(student || teacher) on the student's own sample, so the
policy gradient lowers that KL where the student actually goes.

The teacher is any OpenAI-compatible /v1/completions endpoint answering vLLM's `prompt_logprobs`
(vLLM, or `composer-jax serve`: `inference/server/prompt_logprobs.py`): the generation's whole
token sequence is sent as the prompt with prompt_logprobs 0 and max_tokens 1 (vLLM generates at
least one token; it is ignored), and entry i of the answer is the teacher's log-probability of
token i given tokens 0..i-1.

Tokenizers: ids are sent, so the teacher must read them as the student's tokenizer does. With
`rl.distill.tokenizer` naming another tokenizer, each generation's text (the student's decoding,
special tokens kept) is re-tokenised by the teacher's; only identical ids are scored, anything
else is refused with `TeacherError` (a token-level KL between two vocabularies is not defined).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from composer_jax.config.rl import DistillConfig
from composer_jax.errors import UserError
from composer_jax.formats.tokenizer import Tokenizer, load_tokenizer
from composer_jax.rl.algo.batch import GenerationRecord, ScoredRollout, TokenGeneration


class TeacherError(UserError, ValueError):
    """The teacher cannot score a generation: its endpoint refused or answered another shape, or
    its tokenizer reads the student's text as other ids."""


def same_ids_check(ids: Sequence[int] | np.ndarray, student: Tokenizer, teacher: Tokenizer, where: str) -> None:
    """Refuse unless the teacher's tokenizer re-tokenises the student's text of `ids` into `ids`."""
    ids = [int(t) for t in ids]
    text = student.decode(ids)
    again = teacher.encode_with_specials(text)
    if again == ids:
        return
    k = next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))
    mine = ids[k] if k < len(ids) else None
    theirs = again[k] if k < len(again) else None
    raise TeacherError(
        f"{where}: the teacher's tokenizer (rl.distill.tokenizer) re-tokenises the student's text into other "
        f"ids: at token {k} the student has {mine!r} ({student.decode(ids[k : k + 1])!r}) and the teacher "
        f"{theirs!r} ({len(ids)} vs {len(again)} tokens). Distillation compares per-token log-probabilities, "
        f"which needs one tokenization: use a teacher with the student's tokenizer (rl.distill.tokenizer: '')"
    )


def read_prompt_logprobs(body: Any, ids: Sequence[int] | np.ndarray, where: str) -> np.ndarray:
    """vLLM's prompt_logprobs answer for prompt `ids` -> float64[n] (index 0: 0.0, no prediction)."""
    try:
        rows = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise TeacherError(
            f"{where}: the teacher's answer has no choices[0].prompt_logprobs; the endpoint must support vLLM's "
            f"prompt_logprobs (vLLM, or composer-jax serve); got {str(body)[:200]}"
        ) from None
    if not isinstance(rows, list) or len(rows) != len(ids):
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise TeacherError(f"{where}: prompt_logprobs has {got} entries for the {len(ids)} prompt tokens")
    out = np.zeros(len(ids), np.float64)
    for i in range(1, len(ids)):
        entry = rows[i].get(str(int(ids[i]))) if isinstance(rows[i], dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), (int, float)):
            raise TeacherError(
                f"{where}: prompt_logprobs[{i}] holds no logprob of the prompt's token {int(ids[i])}: {rows[i]!r:.200}"
            )
        out[i] = float(entry["logprob"])
    return out


@dataclasses.dataclass
class Teacher:
    """A teacher endpoint (`DistillConfig`); student: the run's tokenizer (for the tokenizer check)."""

    cfg: DistillConfig
    student: Tokenizer | None = None
    http: httpx.Client | None = None

    def __post_init__(self) -> None:
        headers = {}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise TeacherError(
                    f"rl.distill.api_key_env={self.cfg.api_key_env!r}: that environment variable is not set; set "
                    f"it to the teacher's key, or give api_key_env: '' for an endpoint without one"
                )
            headers["Authorization"] = f"Bearer {key}"
        if self.http is None:
            self.http = httpx.Client(timeout=self.cfg.timeout_s, headers=headers)
        self.teacher_tok = load_tokenizer(self.cfg.tokenizer) if self.cfg.tokenizer else None
        if self.teacher_tok is not None and self.student is None:
            raise ValueError("a teacher tokenizer is compared with the student's: pass student=")

    def logprobs(self, ids: Sequence[int] | np.ndarray, where: str = "generation") -> np.ndarray:
        """The teacher's log-probability of each token of `ids` given those before it: float64[n]."""
        if self.teacher_tok is not None:
            assert self.student is not None
            same_ids_check(ids, self.student, self.teacher_tok, where)
        assert self.http is not None
        body = {
            "model": self.cfg.model,
            "prompt": [int(t) for t in ids],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        url = self.cfg.teacher_url.rstrip("/") + "/completions"
        try:
            resp = self.http.post(url, json=body)
        except httpx.HTTPError as e:
            raise TeacherError(f"{where}: the teacher at {url} did not answer: {e!r}") from None
        if resp.status_code != 200:
            raise TeacherError(f"{where}: the teacher at {url} answered {resp.status_code}: {resp.text[:300]}")
        return read_prompt_logprobs(resp.json(), ids, where)

    def score(self, rollouts: Sequence[ScoredRollout]) -> list[ScoredRollout]:
        """The rollouts with every generation's `teacher_logprobs` attached (as `GenerationRecord`s),
        `cfg.concurrency` requests at a time."""
        gens = [(i, j, g) for i, r in enumerate(rollouts) for j, g in enumerate(r.generations)]
        with concurrent.futures.ThreadPoolExecutor(self.cfg.concurrency) as pool:
            futures = [pool.submit(self.logprobs, g.tokens, f"rollout {i} generation {j}") for i, j, g in gens]
            scores = [f.result() for f in futures]
        out: list[list[TokenGeneration]] = [[] for _ in rollouts]
        for (i, _, g), teacher in zip(gens, scores):
            out[i].append(
                GenerationRecord(g.tokens, g.loss_mask, g.logprobs, g.versions, g.routing, teacher_logprobs=teacher)
            )
        return [dataclasses.replace(r, generations=gens_i) for r, gens_i in zip(rollouts, out)]

    def close(self) -> None:
        if self.http is not None:
            self.http.close()

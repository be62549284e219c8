"""The judges against the project's own `composer-jax serve` (its OpenAI server over an engine, in a
thread): a tiny random model's answers are gibberish, so its verdicts are unparsable - neutral,
counted, never cached - while the request, the key and the response's shape work end to end, and
the unsupported-claims rule still penalises without asking it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jax
import pytest
from support.serve_thread import CFG, KEY, TOK, app_in_thread, stop_app

import composer_jax as cj
from composer_jax.config import JudgeConfig
from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
from composer_jax.inference.engine.thread_engine import Engine
from composer_jax.inference.server.app import OpenAIServer
from composer_jax.rl.algo.rewards import RewardBreakdown, mean_components, with_judged
from composer_jax.rl.judges.panel import JudgePanel
from composer_jax.rl.judges.rubrics import JudgeInputs, ToolCall

MAX_LEN = 512  # the shipped rubrics' prompts are ~400 tokens with inputs cut to 100 characters


@pytest.mark.slow
def test_judges_against_serve_unparsable_verdicts_are_neutral():
    """Slow (a 512-token engine's compile); test_judges.py's stub tests keep every outcome's
    property in the default suite."""
    cfg = dataclasses.replace(CFG, max_position_embeddings=MAX_LEN)
    params = cj.init_params(cfg, jax.random.key(0))
    engine = Engine(
        lambda p, v: Sampler(p, cfg, SamplerSettings(slots=2, max_len=MAX_LEN), version=v), params, 1, max_queued=4
    )
    engine.start()
    server = OpenAIServer(engine, TOK, model_name="judge", api_key=KEY)
    url, http, thread = app_in_thread(server.app)
    common = dict(endpoint=url + "/v1", model="judge", api_key_env="SERVE_KEY", max_tokens=8, max_input_chars=100)
    judges = [
        JudgeConfig(rubric="communication", weight=0.1, **common),
        JudgeConfig(rubric="unsupported_claims", weight=0.2, **common),
    ]
    pytest_run = ToolCall("run_shell", {"command": "pytest -q"}, json.dumps({"exit_code": 0, "stdout": "1 passed"}))
    inputs = [
        JudgeInputs(
            "Fix add() in calc.py.", "I changed add() in calc.py and ran pytest: 1 passed.", "+a + b", (pytest_run,)
        ),
        JudgeInputs("Fix add() in calc.py.", "Fixed it; all tests pass.", "+a + b", ()),  # the rule's
    ]

    async def go():
        panel = JudgePanel(judges, environ={"SERVE_KEY": KEY})
        try:
            first = await panel.judge_inputs(inputs)
            again = await panel.judge_inputs(inputs)
        finally:
            await panel.aclose()
        return first, again, [j.requests for j in panel.judges]

    try:
        first, again, requests = asyncio.run(go())
    finally:
        stop_app(http, thread)
        engine.stop()
    (comm1, claims1), (comm2, claims2) = first
    assert comm1.outcome == comm2.outcome == claims1.outcome == "unparsable"
    assert claims2.outcome == "rule" and claims2.value == -0.2
    assert again == first  # unparsable verdicts are not cached: asked again, unparsable again
    assert requests == [4, 2]
    logged = mean_components([with_judged(RewardBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0), t) for t in first])
    assert logged["reward/judge_communication_unparsable"] == 2.0
    assert logged["reward/judge_unsupported_claims_rule_penalised"] == 1.0
    assert logged["reward/judge_communication"] == 0.0 and logged["reward/total"] == pytest.approx(-0.1)

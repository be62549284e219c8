"""The judged behaviour terms (rl/judges/) against a stub OpenAI-compatible endpoint served over HTTP:
verdicts parsed from answers built with the `openai` package's own response types, requests
deduplicated and cached by (rubric, version, model, inputs), at most `concurrency` in flight, a
deadline that turns a slow answer into a neutral, counted timeout, unparsable answers and failed
requests neutral and counted; the rule-based check of unsupported claims (no request); the terms in
the reward, its logs and the persisted group; the config's checks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
import types

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from support.rl_groups import make_group
from support.serve_thread import app_in_thread, stop_app

from composer_jax.config import ConfigError, JudgeConfig, RewardConfig, load_config
from composer_jax.config.rl import JUDGE_RUBRICS, RULED_RUBRICS
from composer_jax.rl.algo.rewards import (
    JudgedTerm,
    RewardBreakdown,
    RolloutStats,
    compose_reward,
    mean_components,
    with_judged,
)
from composer_jax.rl.judges.panel import JudgePanel, completion_text, judge_keys
from composer_jax.rl.judges.rubrics import (
    FIELDS,
    RUBRICS,
    JudgeInputs,
    ToolCall,
    inputs_of,
    parse_verdict,
    placeholders,
    unsupported_claim,
)
from composer_jax.rl.rollout.agent import Rollout
from composer_jax.rl.rollout.group_store import GroupStore
from composer_jax.rl.samplers.policy import Generation

openai_types = pytest.importorskip("openai.types.chat")

KEY = "judge-key-0123456789"


def _completion(text: str) -> dict:
    """A chat completion as the openai package builds one (the oracle of the response's shape)."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

    msg = ChatCompletionMessage(role="assistant", content=text)
    done = ChatCompletion(
        id="cmpl-1",
        object="chat.completion",
        created=0,
        model="stub",
        choices=[Choice(index=0, finish_reason="stop", message=msg)],
    )
    return done.model_dump(mode="json")


class Stub:
    """A judge endpoint: what it answers is set by markers in the task ([sleep=S], [say=TEXT],
    [status=N], [garbage]); it records every request and the most in flight at once."""

    def __init__(self) -> None:
        self.url = ""
        self.app = FastAPI()
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

        @self.app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            text = body["messages"][-1]["content"]
            with self.lock:
                self.bodies.append(body)
                self.auth.append(request.headers.get("authorization"))
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                if m := re.search(r"\[sleep=([\d.]+)\]", text):  # until then, or until the client goes
                    end = time.monotonic() + float(m.group(1))
                    while time.monotonic() < end and not await request.is_disconnected():
                        await asyncio.sleep(0.02)
                if m := re.search(r"\[status=(\d+)\]", text):
                    return JSONResponse({"error": {"message": "no"}}, status_code=int(m.group(1)))
                if "[garbage]" in text:
                    return JSONResponse({"result": "not a completion"})
                m = re.search(r"\[say=([^\]]*)\]", text)
                return JSONResponse(_completion(m.group(1).replace("|", "\n") if m else "Fine.\nSCORE: 0.75"))
            finally:
                with self.lock:
                    self.in_flight -= 1


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    url, http, thread = app_in_thread(s.app)
    s.url = url + "/v1"
    yield s
    stop_app(http, thread)


def _x(task: str, final: str | None = "I changed calc.py: add() now adds. I ran pytest; it passed.", calls=None):
    run = ToolCall("run_shell", {"command": "pytest -q"}, json.dumps({"exit_code": 0, "stdout": "1 passed"}))
    return JudgeInputs(
        task, final, "--- a/calc.py\n+++ b/calc.py\n-a - b\n+a + b", tuple([run] if calls is None else calls)
    )


def _judge(stub, **kw) -> JudgeConfig:
    base = dict(rubric="communication", weight=0.1, endpoint=stub.url, model="stub", api_key_env="JUDGE_KEY")
    return JudgeConfig(**{**base, **kw})


def _run(judges, inputs, *, rounds=1, then=None):
    """`rounds` rounds of judging `inputs` with one panel; `then(panel)`, awaited after them."""

    async def go():
        panel = JudgePanel(judges, environ={"JUDGE_KEY": KEY})
        try:
            out = [await panel.judge_inputs(inputs) for _ in range(rounds)]
            if then is not None:
                out.append(await then(panel))
        finally:
            await panel.aclose()
        return out

    return asyncio.run(go())


def test_verdicts_are_parsed_deduplicated_and_cached_by_rubric_version(stub):
    n0 = len(stub.bodies)
    inputs = [_x("task A"), _x("task B"), _x("task A"), _x("task C [say=Clear.|SCORE: 0.25]")]

    async def bump_version(panel):  # the same inputs under another rubric version: not the cached verdict
        judge = panel.judges[0]
        judge.rubric = dataclasses.replace(judge.rubric, version=2)
        return await panel.judge_inputs(inputs[:1])

    first, again, bumped = _run([_judge(stub)], inputs, rounds=2, then=bump_version)
    # 3 distinct inputs: 3 requests; the repeated task A shares the first one's verdict
    terms = [t for (t,) in first]
    assert [t.outcome for t in terms] == ["verdict"] * 4
    assert [t.score for t in terms] == [0.75, 0.75, 0.75, 0.25]
    assert [t.cached for t in terms] == [False, False, True, False]
    # a bonus: w (2 s - 1)
    assert [t.value for t in terms] == pytest.approx([0.05, 0.05, 0.05, -0.05])
    assert {t.version for t in terms} == {1} and {t.name for t in terms} == {"communication"}
    # the second round: every verdict from the cache, no request; the bumped version: one more
    assert all(t.cached and t.score for (t,) in again)
    ((t,),) = bumped
    assert not t.cached and t.version == 2 and t.score == 0.75
    assert len(stub.bodies) - n0 == 3 + 1
    # the request: the model, temperature 0, the token budget, the key from the named variable
    body = stub.bodies[n0 + 2]
    assert body["model"] == "stub" and body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert set(stub.auth[n0:]) == {f"Bearer {KEY}"}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    prompts = [b["messages"][1]["content"] for b in stub.bodies[n0 : n0 + 3]]
    assert sorted(p.split("## Task\n")[1].split("\n")[0] for p in prompts) == [
        "task A",
        "task B",
        "task C [say=Clear.|SCORE: 0.25]",
    ]
    for part in ("I ran pytest", "+a + b", "pytest -q", "1 passed"):
        assert part in prompts[0]


def test_concurrency_is_bounded_and_a_slow_verdict_times_out_neutral(stub):
    inputs = [_x(f"task {i} [sleep=0.3]") for i in range(6)]
    stub.most_in_flight = 0
    t0 = time.perf_counter()
    (terms,) = _run([_judge(stub, concurrency=2, timeout_s=10.0)], inputs)
    took = time.perf_counter() - t0
    assert [t.outcome for (t,) in terms] == ["verdict"] * 6
    # 6 requests of 0.3 s, 2 at a time: 3 waves, never more than 2 in flight
    assert stub.most_in_flight == 2 and 0.85 < took < 6.0

    # one slow answer among quick ones, a deadline of 0.5 s: the quick ones score, the slow one is a
    # neutral timeout, and the batch returns at the deadline, not after the slow answer
    inputs = [_x("quick 1"), _x("slow [sleep=30]"), _x("quick 2")]
    t0 = time.perf_counter()
    (terms,) = _run([_judge(stub, timeout_s=0.5)], inputs)
    assert time.perf_counter() - t0 < 5.0
    assert [t.outcome for (t,) in terms] == ["verdict", "timeout", "verdict"]
    slow = terms[1][0]
    assert slow.value == 0.0 and slow.score is None and not slow.cached


def test_unparsable_and_failed_verdicts_are_neutral_and_counted(stub):
    inputs = [
        _x("a [say=Looks good to me.]"),  # no SCORE line
        _x("b [say=SCORE: 1.7]"),  # out of [0, 1]
        _x("c [status=500]"),
        _x("d [garbage]"),  # 200, but no chat completion
        _x("e [say=**SCORE:** 0.5|SCORE: 1]"),  # the last SCORE line counts
    ]
    (terms,) = _run([_judge(stub), _judge(stub, rubric="unsupported_claims", weight=0.2)], inputs)
    comm = [c for c, _ in terms]
    claims = [u for _, u in terms]
    assert [t.outcome for t in comm] == ["unparsable", "unparsable", "error", "error", "verdict"]
    assert [t.value for t in comm[:4]] == [0.0] * 4 and comm[4].value == pytest.approx(0.1)
    # a penalty: -w s
    assert claims[4].outcome == "verdict" and claims[4].value == pytest.approx(-0.2)
    # unreachable endpoint: an error, not a raise
    dead = JudgeConfig(rubric="communication", weight=0.1, endpoint="http://127.0.0.1:9/v1", timeout_s=5.0)
    ((t,),) = _run([dead], [_x("f")])[0]
    assert t.outcome == "error" and t.value == 0.0

    logged = mean_components([with_judged(RewardBreakdown(1.0, 1.0, 0.0, 0.0, 0.0, 0.0), ts) for ts in terms])
    assert logged["reward/judge_communication_unparsable"] == 2.0
    assert logged["reward/judge_communication_errors"] == 2.0
    assert logged["reward/judge_communication_verdicts"] == 1.0
    assert logged["reward/judge_communication_version"] == 1.0
    assert logged["reward/judge_communication"] == pytest.approx(0.1 / 5)
    assert logged["reward/total"] == pytest.approx(1.0 + (0.1 - 0.2) / 5)


def test_the_rule_penalises_unsupported_claims_without_a_request(stub):
    ok = json.dumps({"exit_code": 0, "stdout": "3 passed"})
    failed = json.dumps({"exit_code": 1, "stdout": "1 failed"})
    tests = lambda result: ToolCall("run_shell", {"command": "python -m pytest -q tests"}, result)
    read = ToolCall("read_file", {"path": "calc.py"}, '{"text": "..."}')
    cases = [
        # (final message, calls, penalised by rule)
        ("Fixed add(). All tests pass.", [read], True),  # no test ran
        ("Fixed add(). All tests pass.", [tests(failed), read], True),  # the last test run failed
        ("Fixed add(). All tests pass.", [tests(failed), tests(ok)], False),
        ("I ran the script and it printed 3.", [read], True),  # ran nothing
        ("Verified the fix.", [], True),  # no tool at all
        ("Verified the fix by reading calc.py.", [read], False),
        ("I could not run the tests. They should pass.", [read], False),  # denied, hedged
        ("Changed calc.py to add.", [read], False),
    ]
    for final, calls, want in cases:
        got = unsupported_claim(_x("t", final, calls))
        assert (got is not None) == want, (final, got)

    n0 = len(stub.bodies)
    inputs = [_x("t", final, calls) for final, calls, _ in cases]
    (terms,) = _run([_judge(stub, rubric="unsupported_claims", weight=0.2)], inputs)
    ruled = [i for i, (_, _, want) in enumerate(cases) if want]
    assert [i for i, (t,) in enumerate(terms) if t.outcome == "rule"] == ruled
    assert all(terms[i][0].value == -0.2 and terms[i][0].score == 1.0 for i in ruled)
    assert len(stub.bodies) - n0 == len(cases) - len(ruled)  # the judge reads only the rest

    # the rule alone (no endpoint): the rest is neutral; no final message: neutral, no request
    rule_only = JudgeConfig(rubric="unsupported_claims", weight=0.2)
    (terms,) = _run([rule_only], [*inputs[:3], _x("t", None)])
    assert [t.outcome for (t,) in terms] == ["rule", "rule", "no_judge", "no_message"]
    assert len(stub.bodies) - n0 == len(cases) - len(ruled)


def test_inputs_of_a_rollout_and_the_rubrics():
    call = {"id": "c1", "type": "function", "function": {"name": "run_shell", "arguments": '{"command": "pytest"}'}}
    g1 = Generation(
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Fix add()."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"exit_code": 0}'},
        ]
    )
    g2 = Generation([{"role": "user", "content": "Fix add().\n\nsummary"}, {"role": "assistant", "content": "Done."}])
    r = Rollout("t", 0, [g1, g2], "answer", {"reward": 1.0, "diff": "+x"})
    x = inputs_of(r)
    assert x.task == "Fix add()." and x.final_message == "Done." and x.diff == "+x"
    assert x.calls == (ToolCall("run_shell", {"command": "pytest"}, '{"exit_code": 0}'),)
    assert inputs_of(dataclasses.replace(r, finish_reason="turns")).final_message is None

    assert tuple(RUBRICS) == JUDGE_RUBRICS and tuple(n for n, r in RUBRICS.items() if r.rule) == RULED_RUBRICS
    for rubric in RUBRICS.values():
        assert placeholders(rubric.template) == set(FIELDS)
        long = JudgeInputs("T" * 5000, "M" * 5000, "D" * 5000, ())
        text = rubric.render(long, 300)[1]["content"]
        assert "T" * 300 in text and "T" * 301 not in text and "more characters cut" in text
    assert parse_verdict("reasons\nSCORE: 0.4\n") == 0.4 and parse_verdict("score = 1") == 1.0
    assert parse_verdict("SCORE: 2") is None and parse_verdict("") is None and parse_verdict("0.5") is None
    assert completion_text(_completion("SCORE: 1")) == "SCORE: 1"
    with pytest.raises(ValueError, match="not a chat completion"):
        completion_text({"choices": []})


def test_judged_terms_in_the_reward_and_the_persisted_group(tmp_path):
    b = compose_reward(RolloutStats(grade=1.0, tokens=5, turns=2, tool_calls=1), RewardConfig())
    t1 = JudgedTerm("communication", 1, 0.05, "verdict", 0.75)
    t2 = JudgedTerm("unsupported_claims", 1, -0.2, "rule", 1.0)
    judged = with_judged(b, [t1, t2])
    assert judged.total == pytest.approx(b.total - 0.15) and judged.judged == (t1, t2)
    assert with_judged(judged, [t1]).total == pytest.approx(b.total + 0.05)  # replaced, not added twice
    with pytest.raises(ValueError, match="neutral"):
        JudgedTerm("communication", 1, 0.1, "timeout")

    group = make_group(7, [[1, 1], [1, 2]])
    group.rewards = [with_judged(x, [t1, t2]) for x in group.rewards]
    store = GroupStore(tmp_path)
    store.save(group)
    assert store.load(7).rewards == group.rewards
    # a group persisted without judges (an earlier run's) still loads
    assert RewardBreakdown.from_dict({**b.as_dict(), "judged": []}) == b
    logged = mean_components(group.rewards)
    assert logged["reward/judge_unsupported_claims_rule_penalised"] == 2.0
    assert logged["reward/judge_communication_score"] == 0.75


def test_judge_config_checks(monkeypatch):
    cfg = load_config(
        "configs/rl/tiny_disable_debug.yaml",
        [
            "rl.reward.judges=[{rubric: communication, weight: 0.1, endpoint: 'http://h:1/v1', model: j},"
            " {rubric: unsupported_claims, weight: 0.2}]"
        ],
        num_devices=None,
    )
    assert [j.rubric for j in cfg.rl.reward.judges] == ["communication", "unsupported_claims"]
    assert load_config("configs/rl/tiny_disable_debug.yaml", [], num_devices=None).rl.reward.judges == ()
    bad = [
        (dict(rubric="politeness"), "rubric='politeness' is not accepted; accepted: communication, unsupported"),
        (dict(rubric="communication"), "needs a judge"),
        (dict(rubric="communication", endpoint="h:1"), "expected an http:// or https:// URL"),
        (dict(rubric="unsupported_claims", api_key_env="sk-live-123"), "NAME of an environment variable"),
        (dict(rubric="unsupported_claims", timeout_s=0), "timeout_s=0"),
        (dict(rubric="unsupported_claims", concurrency=0), "concurrency=0: expected an integer >= 1"),
        (dict(rubric="unsupported_claims", weight=-1.0), "weight=-1.0"),
    ]
    for kw, msg in bad:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            JudgeConfig(**kw)
    claims = JudgeConfig(rubric="unsupported_claims")
    with pytest.raises(ConfigError, match=re.escape("rl.reward.judges[1].rubric='unsupported_claims' is given twice")):
        RewardConfig(judges=(claims, claims))
    keyed = JudgeConfig(rubric="communication", endpoint="http://h:1/v1", api_key_env="MY_JUDGE_KEY")
    with pytest.raises(ConfigError, match=re.escape("judges[0].api_key_env='MY_JUDGE_KEY': that environment")):
        judge_keys([keyed], {})
    assert judge_keys([keyed, claims], {"MY_JUDGE_KEY": "k"}) == ["k", ""]


def test_the_rollout_side_adds_the_judged_terms_to_a_finished_group(stub):
    """`RolloutSide._sample` (the method the rollout queue calls) judges the group's rollouts and
    adds the terms to their rewards before the group is persisted and queued."""
    from composer_jax.rl.rollout.side import RolloutSide

    group = make_group(3, [[1, 1], [1, 1]])
    group.rollouts[0].generations[0].messages.append({"role": "assistant", "content": "Changed add(). Verified."})
    group.rollouts[1].generations[0].messages.append({"role": "assistant", "content": "Changed add()."})
    before = [b.total for b in group.rewards]

    async def go():
        async def no_wait():
            return None

        async def sampled(pool, client, cfg, index):
            return group

        side = types.SimpleNamespace(
            wait_for_env=no_wait,
            _sample_group=sampled,
            pool=None,
            client=None,
            cfg=None,
            judges=JudgePanel(
                [_judge(stub), JudgeConfig(rubric="unsupported_claims", weight=0.2)], environ={"JUDGE_KEY": KEY}
            ),
        )
        try:
            return await RolloutSide._sample(side, 3, 5)
        finally:
            await side.judges.aclose()

    got = asyncio.run(go())
    assert got.version == 5
    # rollout 0 says "Verified." having called no tool: the rule; both messages: the stub's 0.75
    assert [[t.outcome for t in b.judged] for b in got.rewards] == [["verdict", "rule"], ["verdict", "no_judge"]]
    assert [b.total for b in got.rewards] == pytest.approx([before[0] + 0.05 - 0.2, before[1] + 0.05])

"""The agent loop against the real environment server: tool calls, bad calls as observations,
budgets, self-summarisation, and a rollout restarted when its server dies.

The policy here is scripted (the loop is under test, not a model): each turn is text in the chat
template, tokenised and read back by the real `parse_assistant`, exactly as a sampled turn is."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.bwrap import needs_bwrap, require_bwrap
from support.live_env import ENV_FIXTURE_TASKS, REPO
from support.scripted import ScriptedPolicy, call

from composer_jax.config.agent import AgentConfig
from composer_jax.env.api.client import EnvClient
from composer_jax.env.api.protocol import SYSTEM_PROMPT
from composer_jax.errors import ConfigError
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.rollout.agent import RolloutFailed, run_rollout, turn_seed
from composer_jax.rl.rollout.env_servers import LocalEnvServers

TOKEN = "rl-agent-test-token-0123456789"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(REPO / "assets" / "tokenizer")


@pytest.fixture(scope="module")
def servers():
    require_bwrap()
    with LocalEnvServers(ENV_FIXTURE_TASKS, 2, token=TOKEN) as (urls, _):
        yield urls


def rollout(policy, urls, cfg, task="fix-add", seed=7):
    async def go():
        async with EnvClient(urls, TOKEN, retries=1, backoff_s=0.01) as client:
            return await run_rollout(policy, client, task, cfg, seed=seed)

    return asyncio.run(go())


@needs_bwrap
def test_rollout_fixes_the_task_with_parallel_and_bad_calls(servers, tok):
    turns = [
        "Let me look." + call("read_file", path="calc.py") + call("list_dir", path="."),
        call("read_fil", path="calc.py") + call("read_file", path=3) + '<|tool_call|>{"name": "grep", "argu',
        call("edit_file", path="calc.py", old_string="return a - b", new_string="return a + b"),
        "Fixed `add`: it subtracted.",
    ]
    policy = ScriptedPolicy(turns, tok)

    async def slow_sampler(n: int) -> None:  # each turn takes >= 50 ms, as a sampler's round trip would
        await asyncio.sleep(0.05)

    policy.hook = slow_sampler
    r = rollout(policy, [servers[0]], AgentConfig())
    assert r.finish_reason == "answer" and r.grade["reward"] == 1.0
    # the time split: 4 turns of >= 50 ms awaiting the policy; session, 3 tool requests and grading
    # on the server; the two parts are disjoint pieces of the attempt's wall time
    assert r.policy_s >= 4 * 0.05 and r.env_s > 0
    assert r.policy_s + r.env_s <= r.wall_s
    assert (r.turns, r.tool_calls, r.parallel_tool_turns) == (4, 6, 1)
    # unknown tool, wrong argument type, and the unparseable third call of turn 2
    assert r.broken_tool_calls == 3
    msgs = r.generations[0].messages
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "assistant"] + ["tool"] * 3 + [
        "assistant",
        "tool",
        "assistant",
    ]
    # the system prompt names exactly the session's tools (no web tools: the task does not ask for them)
    assert (
        msgs[0]["content"] == SYSTEM_PROMPT
        and "semantic_search(" in SYSTEM_PROMPT
        and "web_search" not in SYSTEM_PROMPT
    )
    read = json.loads(msgs[3]["content"])
    assert read["path"] == "/app/calc.py" and "return a - b" in read["content"]
    assert msgs[3]["tool_call_id"] == msgs[2]["tool_calls"][0]["id"]
    errors = [json.loads(m["content"])["error"] for m in msgs[6:9]]
    assert "unknown tool 'read_fil'" in errors[0]
    assert "argument 'path'" in errors[1] and "string" in errors[1]
    assert errors[2].startswith("tool call 2: not valid JSON")
    # every turn has its own seed
    assert [q.seed for q in policy.requests] == [turn_seed(7, 0, t) for t in range(4)]


@needs_bwrap
def test_budgets_end_a_rollout(servers, tok):
    looping = [call("list_dir", path=".")] * 10
    r = rollout(ScriptedPolicy(looping, tok), [servers[0]], AgentConfig(max_turns=3))
    assert (r.finish_reason, r.turns, r.grade["reward"]) == ("turns", 3, 0.0)

    policy = ScriptedPolicy(looping, tok, max_context=90)
    r = rollout(policy, [servers[0]], AgentConfig(context_budget=0, max_turn_tokens=8))
    assert r.finish_reason == "context" and r.summaries == 0 and r.turns >= 1
    # every turn was asked for with room for max_turn_tokens; the next one would not have fitted
    assert all(c + 8 <= 90 for c in policy.contexts)
    assert r.generations[0].context_len() + 8 > 90

    few = ScriptedPolicy(looping, tok)
    r = rollout(few, [servers[0]], AgentConfig(max_rollout_tokens=50, max_turn_tokens=40))
    assert r.finish_reason == "tokens" and r.generated_tokens >= 50
    per_turn = len(tok.encode(json.dumps({"name": "list_dir", "arguments": {"path": "."}}))) + 2  # + call, end
    assert [q.max_tokens for q in few.requests] == [min(40, 50 - n * per_turn) for n in range(len(few.requests))]


@needs_bwrap
def test_self_summarisation_starts_a_new_generation(servers, tok):
    turns = [
        call("read_file", path="calc.py"),
        call("list_dir", path="."),
        "Summary: calc.py's add returns a - b; it must return a + b.",
        call("edit_file", path="calc.py", old_string="return a - b", new_string="return a + b"),
        "Done.",
    ]
    policy = ScriptedPolicy(turns, tok)
    # each message counts 10 tokens of context here; a turn's own tokens count as generated
    cfg = AgentConfig(context_budget=120, max_turn_tokens=40, summary_prompt="SUMMARISE NOW")
    r = rollout(policy, [servers[0]], cfg)
    assert r.finish_reason == "answer" and r.grade["reward"] == 1.0
    assert r.summaries == 1 and len(r.generations) == 2 and r.turns == 5
    first, second = (g.messages for g in r.generations)
    assert first[-2] == {"role": "user", "content": "SUMMARISE NOW"}
    assert first[-1]["content"].startswith("Summary: calc.py")
    assert second[1]["role"] == "user" and second[1]["content"].endswith(
        "your summary of that work:\nSummary: calc.py's add returns a - b; it must return a + b."
    )
    assert second[1]["content"].startswith("`calc.add` in /app/calc.py returns the wrong result")
    assert policy.requests[2].max_tokens == cfg.summary_tokens


@needs_bwrap
def test_dead_server_restarts_the_rollout_elsewhere(servers, tok):
    script = [call("read_file", path="calc.py"), call("list_dir", path=".")]
    fix = [call("edit_file", path="calc.py", old_string="return a - b", new_string="return a + b"), "Done."]
    policy = ScriptedPolicy(script + script + fix, tok)
    victim = LocalEnvServers(ENV_FIXTURE_TASKS, 1, token=TOKEN)

    async def kill_on_second_turn(n):
        if n == 2:
            victim.stop()

    policy.hook = kill_on_second_turn
    with victim as ((victim_url,), _):
        r = rollout(policy, [victim_url, servers[0]], AgentConfig())
    # attempt 0 ran on the victim (first in round-robin) and lost its session at turn 2's calls
    assert r.env_retries == 1 and r.server == servers[0]
    assert r.grade["reward"] == 1.0 and r.turns == 4

    with pytest.raises(RolloutFailed, match="all 2 attempts"):
        rollout(ScriptedPolicy(script, tok), [victim_url], AgentConfig(env_retries=1))


def test_agent_config_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"agent.context_budget=100 must exceed agent.max_turn_tokens=512"):
        AgentConfig(context_budget=100)
    with pytest.raises(ConfigError, match=r"agent.max_turns=0 must be >= 1"):
        AgentConfig(max_turns=0)

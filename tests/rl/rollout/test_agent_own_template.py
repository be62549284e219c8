"""The agent loop prompting a token policy in a checkpoint's own chat template (the fixture
templates of tests/fixtures/chat_templates/, one per family, on DeepSeek's real vocabulary): the
policy "samples" a turn whose tokens are a valid tool call in the family's own syntax (forced: a
random model makes none), the loop reads it with that family's parser, the call reaches the
session, and the next prompt, the sampled tokens verbatim plus the template's continuation, is
transformers' rendering of the whole conversation with the session's tools. The default-suite
link of the RL stage in tests/hf/test_open_model_chain.py (slow)."""

from __future__ import annotations

import asyncio
import json

import pytest
from support.chat_templates import FAMILIES, TEXT_ARGUMENT_TEMPLATES, chat_template, oracle, source, vllm_messages

from composer_jax.config.agent import AgentConfig
from composer_jax.env.api.protocol import session_tool_names, system_prompt, tool_schemas
from composer_jax.formats import tool_calls
from composer_jax.rl.rollout.agent import _Episode
from composer_jax.rl.samplers.base import Sampled, TokenSampler

pytest.importorskip("transformers")
NAMES = session_tool_names(False)
TOOLS = tool_schemas(NAMES)
CALL_ARGS = {"path": "src", "pattern": "TODO"}


class ForcedTurns(TokenSampler):
    """A token policy whose turns are given token lists (log-probability -0.5 each, version 0)."""

    max_context = 100_000

    def __init__(self, fmt, turns: list[list[int]]):
        self.tok, self.chat, self.turns = fmt.tok, fmt, list(turns)

    async def sample(self, tokens, req) -> Sampled:
        turn = self.turns.pop(0)
        return Sampled(turn, [-0.5] * len(turn), [0] * len(turn))


class Session:
    """The parts of a `RemoteSession` the loop uses; records the calls it is asked to run."""

    instruction = "Find the TODOs under src."
    tools = TOOLS
    server_url = "memory://"

    def __init__(self):
        self.calls: list[list[dict]] = []

    async def call_tools(self, calls: list[dict]) -> list[dict]:
        self.calls.append(calls)
        return [{"ok": True, "result": {"matches": ["src/a.py:3: # TODO"]}} for _ in calls]


def _assistant_tokens(fmt, before: list[dict], message: dict) -> list[int]:
    """The tokens the template gives `message` after `before`: what a model trained on it samples."""
    whole, mask = fmt.conversation([*before, message], tools=TOOLS)
    start = end = len(fmt.prompt(before, tools=TOOLS))
    assert mask[start] == 1.0 and mask[start - 1] == 0.0
    while end < len(mask) and mask[end] == 1.0:  # (a template may write a separator after the turn)
        end += 1
    return whole[start:end].tolist()


def _reference(family: str, messages: list[dict]) -> list[int]:
    """transformers' rendering of the prompt after `messages` (the oracle), arguments as vLLM hands them."""
    ids = oracle().apply_chat_template(
        vllm_messages(messages, text_arguments=family in TEXT_ARGUMENT_TEMPLATES),
        tools=TOOLS,
        chat_template=source(family),
        tokenize=True,
        add_generation_prompt=True,
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_in_the_models_syntax_reaches_the_session_and_the_next_prompt_is_the_template(family, monkeypatch):
    fmt = chat_template(family)
    opening = [
        {"role": "system", "content": system_prompt(NAMES)},
        {"role": "user", "content": Session.instruction},
    ]
    cid = "functions.grep:0" if family == "kimi_k2" else "call_2_0"  # Kimi K2's calls carry their id
    call = {"id": cid, "type": "function", "function": {"name": "grep", "arguments": json.dumps(CALL_ARGS)}}
    turn1 = {"role": "assistant", "content": "Looking.", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": cid, "content": json.dumps({"matches": ["src/a.py:3: # TODO"]})}
    turn2 = {"role": "assistant", "content": "One TODO, in src/a.py."}
    sampled = [_assistant_tokens(fmt, opening, turn1), _assistant_tokens(fmt, [*opening, turn1, result], turn2)]
    syntaxes: list[str] = []
    parse = tool_calls.parse_turn
    monkeypatch.setattr(tool_calls, "parse_turn", lambda s, text, **kw: syntaxes.append(s) or parse(s, text, **kw))
    session, policy = Session(), ForcedTurns(fmt, sampled)
    episode = _Episode(policy, session, AgentConfig(max_turns=4, context_budget=0), seed=0)
    assert asyncio.run(episode.run()) == "answer"
    assert syntaxes == [fmt.tool_syntax] * 2  # both turns read in the family's own syntax
    assert session.calls == [[{"id": cid, "name": "grep", "arguments": CALL_ARGS}]]
    (gen,) = episode.generations
    assert gen.messages == [*opening, turn1, result, turn2]
    # the second turn's prompt (the first turn's sampled tokens verbatim + the continuation) is the template's
    second = len(gen.tokens) - len(sampled[1])
    assert gen.tokens[:second] == _reference(family, gen.messages[:4]) and gen.tokens[second:] == sampled[1]
    trained = [t for t, m in zip(gen.tokens, gen.loss_mask, strict=True) if m == 1.0]
    assert trained == sampled[0] + sampled[1] and gen.generated == len(trained)
    assert episode.counts.tool_calls == 1 and episode.counts.broken == 0


def test_a_perturbed_call_is_broken_and_never_runs():
    """The same turn with its arguments cut (the family's end marker gone): a broken call the model
    is told about, nothing run."""
    fmt = chat_template("deepseek_v3")
    opening = [{"role": "system", "content": system_prompt(NAMES)}, {"role": "user", "content": Session.instruction}]
    call = {"id": "c", "type": "function", "function": {"name": "grep", "arguments": json.dumps(CALL_ARGS)}}
    whole = _assistant_tokens(fmt, opening, {"role": "assistant", "content": "", "tool_calls": [call]})
    text = fmt.tok.decode(whole[:-1])
    cut = fmt.tok.encode_with_specials(text[: text.index('"TODO"')]) + whole[-1:]
    session = Session()
    episode = _Episode(ForcedTurns(fmt, [cut]), session, AgentConfig(max_turns=1, context_budget=0), seed=0)
    assert asyncio.run(episode.run()) == "turns"
    assert session.calls == [] and episode.counts.broken == 1

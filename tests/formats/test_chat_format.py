"""The contract every `ChatFormat` keeps, on the bundled agent conversations: a whole conversation's
tokens are the first prompt, each assistant turn's own tokens, and the continuations after them, so
the agent loop's multi-turn prompts hold the generated tokens verbatim and SFT trains on the same
ids; the mask covers exactly the assistant turns' tokens; a turn reads back as the message it was."""

import json
from pathlib import Path

import numpy as np
import pytest
from support.chat_templates import FAMILIES, chat_template

from composer_jax.formats.chat_format import ChatFormat, ChatML, chat_format

SFT = Path(__file__).resolve().parents[2] / "assets/sft/train.jsonl"


def _conversations(n: int = 6) -> list[list[dict]]:
    rows = [json.loads(line) for line in SFT.read_text().splitlines() if line.strip()]
    return [r["messages"] if isinstance(r, dict) else r for r in rows[:n]]


def _turns(fmt: ChatFormat, messages: list[dict]) -> tuple[list[int], list[float]]:
    """The agent loop's way: prompt, then per assistant turn its own tokens (as a sampler would
    have produced them: the turn's masked tokens in the whole rendering) and the continuation."""
    whole, mask = fmt.conversation(messages)
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    ids = fmt.prompt(messages[: starts[0]]).tolist()
    out_mask = [0.0] * len(ids)
    for k, a in enumerate(starts):
        # the turn's tokens: the run of masked tokens where the prompt so far ends
        n = 0
        while len(ids) + n < len(whole) and mask[len(ids) + n] == 1.0:
            n += 1
        turn = whole[len(ids) : len(ids) + n].tolist()
        ids += turn
        out_mask += [1.0] * len(turn)
        more = messages[a + 1 : starts[k + 1]] if k + 1 < len(starts) else []
        if more:
            cont = fmt.continuation(more).tolist()
            ids += cont
            out_mask += [0.0] * len(cont)
    return ids, out_mask


@pytest.fixture(params=["composer-chatml-v1", *FAMILIES])
def fmt(request, tok) -> ChatFormat:
    """composer-chatml-v1 and the fixture Jinja templates (tests/fixtures/chat_templates/)."""
    return ChatML(tok) if request.param == "composer-chatml-v1" else chat_template(request.param)


def test_chat_format_picks_the_tokenizers_own(tok):
    assert isinstance(chat_format(tok), ChatML) and chat_format(tok).unavailable() is None
    assert chat_format(tok).end_of_turn == (tok.token_id("<|im_end|>"),)


def test_turn_by_turn_prompts_are_the_whole_conversation(fmt):
    for messages in _conversations():
        whole, mask = fmt.conversation(messages)
        ids, turn_mask = _turns(fmt, messages)
        # the whole rendering ends the conversation (EOS / the template's end): the turns are its prefix
        assert ids == whole[: len(ids)].tolist()
        assert turn_mask == mask[: len(ids)].tolist()
        assert mask[len(ids) :].sum() == 0


def test_each_turn_reads_back_as_its_message(fmt):
    for messages in _conversations():
        whole, mask = fmt.conversation(messages)
        edges = np.flatnonzero(np.diff(np.concatenate([[0.0], mask, [0.0]])))
        turns = [whole[a:b].tolist() for a, b in zip(edges[::2], edges[1::2], strict=True)]
        wanted = [m for m in messages if m["role"] == "assistant"]
        assert len(turns) == len(wanted)
        for got_ids, want in zip(turns, wanted, strict=True):
            got = fmt.parse(got_ids)
            assert got.finished and not got.malformed
            assert (got.content or None) == (want.get("content") or None)
            names = [c["function"]["name"] for c in want.get("tool_calls") or ()]
            assert [c["function"]["name"] for c in got.tool_calls] == names
            assert got_ids[-1] in fmt.end_of_turn


def test_a_perturbed_turn_breaks_the_contract(fmt):
    """The comparison can fail: a turn's tokens with one token changed no longer read back."""
    messages = next(m for m in _conversations() if any(x.get("tool_calls") for x in m))
    whole, mask = fmt.conversation(messages)
    at = int(np.flatnonzero(mask)[0])
    ids, _ = _turns(fmt, messages)
    ids[at + 1] = (ids[at + 1] + 1) % fmt.tok.vocab_size
    assert ids != whole[: len(ids)].tolist()


def _turn_tokens(fmt: ChatFormat, messages: list[dict]) -> list[tuple[list[int], dict]]:
    whole, mask = fmt.conversation(messages)
    edges = np.flatnonzero(np.diff(np.concatenate([[0.0], mask, [0.0]])))
    wanted = [m for m in messages if m["role"] == "assistant"]
    return [(whole[a:b].tolist(), m) for a, b, m in zip(edges[::2], edges[1::2], wanted, strict=True)]


def test_call_boundaries_split_content_and_stream_whole_calls(fmt):
    """What `serve` streams: content_tokens is the turn's content; closed_calls of a turn cut
    anywhere holds exactly the calls that were complete before the cut, never a partial one."""
    turns = [t for m in _conversations() for t in _turn_tokens(fmt, m) if t[1].get("tool_calls")]
    assert turns
    for ids, want in turns[:4]:
        content = fmt.tok.decode(fmt.content_tokens(ids), skip_special_tokens=True)
        assert content.strip() == (want.get("content") or "")
        names = [c["function"]["name"] for c in want["tool_calls"]]
        starts = [i for i, t in enumerate(ids) if t in fmt.call_start]
        # a call is whole at its end marker where the format has one (one per call), else at the next
        # call's start (composer-chatml-v1: one start per call) or the end of the turn
        ends = [i for i, t in enumerate(ids) if t in fmt.call_end]
        assert len(ends or starts) == len(names)
        for cut in range(starts[0] + 1, len(ids) + 1):
            closed = fmt.closed_calls(ids[:cut])
            got = [c["function"]["name"] for c in fmt.parse(closed).tool_calls] if closed else []
            if ends:
                done = len(names) if cut == len(ids) else sum(1 for e in ends if e < cut)
            else:
                done = sum(1 for s in starts[1:] if s < cut) + (1 if cut == len(ids) else 0)
            assert got == names[:done], (cut, got)


def test_session_tools_reach_the_prompt_only_where_the_format_takes_them(fmt, tok):
    """The agent loop passes a session's tool schemas to `begin`; a format with native tools renders
    them (its template's `tools`), composer-chatml-v1 keeps the prompt its SFT conversations taught."""
    from composer_jax.env.api.protocol import tool_schemas
    from composer_jax.rl.samplers.base import TokenSampler

    class Stub(TokenSampler):
        max_context = 10_000

        def __init__(self, tok, chat):
            self.tok, self.chat = tok, chat

        async def sample(self, tokens, req):  # pragma: no cover - never sampled here
            raise AssertionError

    class Native(ChatML):
        native_tools = True

    messages = _conversations(1)[0][:2]
    begun = Stub(fmt.tok, fmt).begin(messages, tools=tool_schemas()).tokens
    plain = fmt.prompt(messages).tolist()
    assert begun == (fmt.prompt(messages, tools=tool_schemas()).tolist() if fmt.native_tools else plain)
    assert fmt.prompt(messages, tools=tool_schemas()).tolist() != plain  # every format can render tools
    if isinstance(fmt, ChatML):
        native = Stub(tok, Native(tok)).begin(messages, tools=tool_schemas()).tokens
        assert native == fmt.prompt(messages, tools=tool_schemas()).tolist() != plain

"""OpenAI conformance of the server's request reading and response shapes, without a server:
tool_choice (what is forced), parallel_tool_calls, the developer role, streamed tool-call deltas
and the error shapes, checked against the `openai` package's own types and stream accumulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from composer_jax.formats.chatml import render_chat_text, render_prompt  # noqa: E402
from composer_jax.formats.tokenizer import load_tokenizer  # noqa: E402
from composer_jax.inference.engine.driver import Event  # noqa: E402
from composer_jax.inference.engine.slot_table import Completion  # noqa: E402
from composer_jax.inference.server import openai_api as api  # noqa: E402
from composer_jax.inference.server.app import ChoiceStream  # noqa: E402

TOK = load_tokenizer(Path(__file__).resolve().parents[3] / "assets" / "tokenizer")
USER = [{"role": "user", "content": "Show a.py and b.py"}]
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    }
    for name in ("read_file", "list_dir")
]
CALL, END = TOK.token_id("<|tool_call|>"), TOK.token_id("<|im_end|>")


def _chat(**body) -> api.Generation:
    return api.parse_chat({"messages": USER, **body}, tok=TOK, served="m", max_len=4096, vocab=TOK.vocab_size)


def _choice(gen: api.Generation, tokens: list[int], reason: str = "stop") -> dict:
    n = len(tokens)
    return api.build_choice(
        gen,
        0,
        TOK,
        tokens=tokens,
        logprobs=[-0.5] * n,
        versions=[0] * n,
        finish_reason=reason,
        routing=None,
        prompt_len=len(gen.prompts[0]),
        call_id_prefix="call_t",
    )


def _completion(choice: dict) -> ChatCompletion:
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    return ChatCompletion.model_validate(body)


TWO_CALLS = [
    *TOK.encode("Reading."),
    CALL,
    *TOK.encode('{"name": "read_file", "arguments": {"path": "src/pkg/a.py"}}'),
    CALL,
    *TOK.encode('{"name": "list_dir", "arguments": {"path": "some/long/directory/name"}}'),
    END,
]


# ---------------------------------------------------------------------------- tool_choice
def test_tool_choice_forces_the_opening_of_a_call():
    base = render_prompt(USER, TOK, tools=TOOLS).tolist()
    assert _chat(tools=TOOLS).prompts[0] == base and _chat(tools=TOOLS, tool_choice="auto").forced == []
    required = _chat(tools=TOOLS, tool_choice="required")
    assert required.forced == [CALL] and required.prompts[0] == base + [CALL] and required.tool_choice == "required"
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "list_dir"}})
    assert named.prompts[0] == base + named.forced and named.tool_choice == "function"
    assert TOK.decode(named.forced) == '<|tool_call|>{"name": "list_dir", "arguments":'
    # a function may be named like a mode: the name is forced all the same
    auto = [{"type": "function", "function": {"name": "auto"}}]
    forced_auto = _chat(tools=auto, tool_choice={"type": "function", "function": {"name": "auto"}}).forced
    assert TOK.decode(forced_auto) == '<|tool_call|>{"name": "auto", "arguments":'
    # the opening tokenizes as the same text does inside a whole call (the template's spelling)
    whole = TOK.encode('{"name": "list_dir", "arguments": {"path": "."}}')
    assert whole[: len(named.forced) - 1] == named.forced[1:]

    # the model writes the rest: the call is read from the forced opening + the generated tokens
    args = TOK.encode(' {"path": "src"}}') + [END]
    c = _completion(_choice(named, args)).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (tc,) = c.message.tool_calls
    assert tc.function.name == "list_dir" and json.loads(tc.function.arguments) == {"path": "src"}
    gen = TOK.encode('{"name": "read_file", "arguments": {}}') + [END]
    (tc,) = _completion(_choice(required, gen)).choices[0].message.tool_calls
    assert tc.function.name == "read_file" and tc.id == "call_t_0"


def test_tool_choice_none_offers_and_parses_no_call():
    none = _chat(tools=TOOLS, tool_choice="none")
    assert none.prompts[0] == render_prompt(USER, TOK).tolist()  # no tools block
    assert "# Tools" not in TOK.decode(none.prompts[0]) and none.forced == []
    assert CALL in none.params[0].stop_token_ids  # the turn ends where a call would begin
    c = _completion(_choice(none, TWO_CALLS)).choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "stop" and c.message.content == "Reading."


def test_parallel_tool_calls_false_keeps_the_first_call():
    both = _completion(_choice(_chat(tools=TOOLS), TWO_CALLS)).choices[0].message.tool_calls
    assert [t.function.name for t in both] == ["read_file", "list_dir"]
    one = _chat(tools=TOOLS, parallel_tool_calls=False)
    (first,) = _completion(_choice(one, TWO_CALLS)).choices[0].message.tool_calls
    assert first.function.name == "read_file" and first.id == both[0].id


def test_tool_choice_errors_name_the_value_and_the_tools():
    given = r"function 'grep' is not among the tools given: \['read_file', 'list_dir'\]"
    with pytest.raises(api.ApiError, match=given):
        _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "grep"}})
    with pytest.raises(api.ApiError, match="'required' needs tools; the request gives none") as e:
        _chat(tool_choice="required")
    assert e.value.status == 400 and e.value.param == "tool_choice"
    with pytest.raises(api.ApiError, match="accepted: 'none', 'auto', 'required'"):
        _chat(tools=TOOLS, tool_choice={"type": "function"})
    with pytest.raises(api.ApiError, match="parallel_tool_calls"):
        _chat(tools=TOOLS, parallel_tool_calls="no")


# ---------------------------------------------------------------------------- roles and errors
def test_developer_role_is_rendered_as_system():
    dev = [{"role": "developer", "content": "Be brief."}, *USER]
    sys = [{"role": "system", "content": "Be brief."}, *USER]
    assert render_prompt(dev, TOK, tools=TOOLS).tolist() == render_prompt(sys, TOK, tools=TOOLS).tolist()
    assert render_chat_text(dev, TOOLS) == render_chat_text(sys, TOOLS)
    assert "<|im_start|>system\nBe brief.\n\n# Tools" in render_chat_text(dev, TOOLS)


def test_error_types_are_openai_s():
    # the real API: 401 {"type": "invalid_request_error", "code": "invalid_api_key"}
    assert api.ApiError(401, "x", code="invalid_api_key").body()["error"] == {
        "message": "x",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert api.ApiError(429, "x").type == "rate_limit_error"


# ---------------------------------------------------------------------------- streamed tool calls
def _stream_chunks(gen: api.Generation, tokens: list[int], per_event: int = 1) -> list[dict]:
    """The server's chunks for `tokens` arriving `per_event` at a time, as full chunk bodies."""
    stream = ChoiceStream(TOK, gen, 0, "call_t")
    choices = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    for i in range(0, len(tokens), per_event):
        part = tokens[i : i + per_event]
        choices += stream.on_event(Event("r", part, [-0.5] * len(part), [0] * len(part)))
    n = len(tokens)
    done = Completion("r", gen.prompts[0], tokens, [-0.5] * n, [0] * n, None, "stop")
    choices += stream.on_event(Event("r", completion=done))
    return [
        {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [ch]} for ch in choices
    ]


def _check_tool_call_delta(d: dict, first: bool) -> None:
    """The fields the SDK reads from a tool-call delta, strictly (pydantic ignores extra keys)."""
    assert isinstance(d["index"], int) and isinstance(d["function"]["arguments"], str)
    if first:
        assert set(d) == {"index", "id", "type", "function"} and set(d["function"]) == {"name", "arguments"}
        assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["name"]
    else:
        assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}


@pytest.mark.parametrize("per_event", [1, 3, 1000])
@pytest.mark.parametrize("body", [{}, {"parallel_tool_calls": False}, {"tool_choice": "required"}])
def test_streamed_tool_calls_are_deltas_the_sdk_accumulates_to_the_response(per_event, body):
    gen = _chat(tools=TOOLS, stream=True, **body)
    tokens = TWO_CALLS if not gen.forced else TWO_CALLS[TWO_CALLS.index(CALL) + 1 :]
    want = _completion(_choice(gen, tokens))
    chunks = _stream_chunks(gen, tokens, per_event)
    state = ChatCompletionStreamState(input_tools=TOOLS)
    seen: set[int] = set()
    for body_chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(body_chunk))
        for d in body_chunk["choices"][0].get("delta", {}).get("tool_calls", []):
            _check_tool_call_delta(d, d["index"] not in seen)
            seen.add(d["index"])
    got = state.get_final_completion().choices[0]
    assert got.finish_reason == want.choices[0].finish_reason == "tool_calls"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert (got.message.content or None) == want.choices[0].message.content  # the first chunk sends ""
    pairs = [(t.id, t.function.name, t.function.arguments) for t in got.message.tool_calls]
    assert pairs == [(t.id, t.function.name, t.function.arguments) for t in want.choices[0].message.tool_calls]
    assert len(pairs) == (1 if "parallel_tool_calls" in body else 2)
    deltas = [d for c in chunks for d in c["choices"][0].get("delta", {}).get("tool_calls", [])]
    assert len(deltas) > len(pairs)  # the long arguments come in several fragments
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == tokens


def test_a_call_is_sent_as_soon_as_the_next_one_begins():
    gen = _chat(tools=TOOLS, stream=True)
    second = len(TWO_CALLS) - TWO_CALLS[::-1].index(CALL)  # just after the second <|tool_call|>
    chunks = _stream_chunks(gen, TWO_CALLS)
    sent_at, tokens = {}, 0
    for c in chunks:
        tokens += len(c["choices"][0].get("token_ids", []))
        for d in c["choices"][0].get("delta", {}).get("tool_calls", []):
            sent_at.setdefault(d["index"], tokens)
    assert sent_at == {0: second, 1: len(TWO_CALLS)}

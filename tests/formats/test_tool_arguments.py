"""Tool-call arguments rendered as vLLM renders them (formats/chat_template.py, `template_messages`).

OpenAI clients send `tool_calls[].function.arguments` as JSON text; vLLM parses it into the object
before any chat template runs, for every model. The oracle is transformers' `apply_chat_template`
given OBJECT arguments, on each family's template, for every path that renders a conversation:
the prompt `serve` builds from a request, an SFT row (`conversation`), and the project's own
composer-chatml-v1 through its exported Jinja template. (The agent loop's prompts are checked the
same way in tests/rl/rollout/test_agent_own_template.py.) The arguments here are spelled as clients
spell them: compact (JavaScript's JSON.stringify) and ASCII-escaped (Python's json.dumps), so a
template that writes text as given, or quotes it with `tojson`, renders other ids than vLLM."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from support.chat_templates import (
    BOS,
    EOS,
    TEXT_ARGUMENT_TEMPLATES,
    chat_template,
    oracle,
    source,
    template_tok,
    vllm_messages,
)

from composer_jax.env.api.protocol import session_tool_names, tool_schemas
from composer_jax.formats.chat_format import ChatML
from composer_jax.formats.chat_template import ChatTemplate, template_messages

pytest.importorskip("transformers")
TOOLS = tool_schemas(session_tool_names(False))
CONCATENATED = "call.function.arguments +"  # the DeepSeek-V3 fixture's text concatenation
SFT = Path(__file__).resolve().parents[2] / "assets/sft/train.jsonl"


def _call(i: str, name: str, arguments: str) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLS = [
    _call("c1", "read_file", json.dumps({"path": "/app/cron.py", "start_line": 1}, separators=(",", ":"))),
    _call("c2", "grep", json.dumps({"pattern": "déf match", "path": "/app"})),  # ASCII-escaped: d\u00e9f
]
PROMPT = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Tests fail in cron.py"},
    {"role": "assistant", "content": "Reading it.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "def match(x): ..."},
    {"role": "tool", "tool_call_id": "c2", "content": "cron.py:1"},
]
WHOLE = [*PROMPT, {"role": "assistant", "content": "Found it."}]


def _template(family: str) -> tuple[str, ChatTemplate]:
    """The family's fixture; for DeepSeek-V3 the arguments written `| tojson` as vLLM's DeepSeek-V3
    tool template writes them (the fixture concatenates text, which vLLM cannot render: see below)."""
    if family not in TEXT_ARGUMENT_TEMPLATES:
        return source(family), chat_template(family)
    text = source(family).replace(CONCATENATED, "(call.function.arguments | tojson) +")
    assert text != source(family)
    variables = {"bos_token": BOS, "eos_token": EOS}
    return text, ChatTemplate(text, template_tok(), name=f"{family}-tojson", variables=variables)


def _oracle(template: str, messages: list[dict], **kw) -> list[int]:
    return oracle().apply_chat_template(
        messages, tools=TOOLS, chat_template=template, tokenize=True, return_dict=False, **kw
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "deepseek_v3", "kimi_k2"])
def test_prompt_and_sft_row_are_transformers_with_object_arguments(family):
    text, fmt = _template(family)
    assert not fmt.text_arguments
    want_prompt = _oracle(text, vllm_messages(PROMPT), add_generation_prompt=True)
    assert fmt.prompt(PROMPT, tools=TOOLS).tolist() == want_prompt
    ids, _ = fmt.conversation(WHOLE, tools=TOOLS)
    assert ids.tolist() == _oracle(text, vllm_messages(WHOLE))
    bundled = json.loads(SFT.read_text().splitlines()[0])["messages"]  # its arguments are JSON text too
    assert fmt.conversation(bundled, tools=TOOLS)[0].tolist() == _oracle(text, vllm_messages(bundled))
    if family != "qwen3_coder":  # (its `arguments | items` cannot render text at all)
        # not vacuous: the arguments as the client's text render other ids
        assert _oracle(text, WHOLE) != ids.tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "deepseek_v3", "kimi_k2"])
def test_serve_renders_a_requests_text_arguments_as_vllm(family, monkeypatch):
    from composer_jax.inference.server import openai_api as api

    text, fmt = _template(family)
    monkeypatch.setattr(api, "chat_format", lambda tok: fmt)
    body = {"model": "m", "messages": copy.deepcopy(PROMPT), "tools": TOOLS, "max_tokens": 8}
    gen = api.parse_chat(body, tok=fmt.tok, served="m", max_len=1 << 16, vocab=fmt.tok.vocab_size)
    assert gen.prompts[0] == _oracle(text, vllm_messages(PROMPT), add_generation_prompt=True)
    assert body["messages"] == PROMPT  # the request is not modified


def test_chatml_is_its_exported_template_with_object_arguments(tok, tmp_path):
    """composer-chatml-v1 (Python) against transformers running the export's Jinja template."""
    import transformers

    from composer_jax.hf.tokenizer_files import write_tokenizer_files

    assert write_tokenizer_files(tok, tmp_path, 4096) is None  # the project's template was written
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    fmt = ChatML(tok)

    def want(messages: list[dict], **kw) -> list[int]:
        return hf.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False, **kw)

    assert fmt.prompt(PROMPT, tools=TOOLS).tolist() == want(vllm_messages(PROMPT), add_generation_prompt=True)
    assert fmt.conversation(WHOLE, tools=TOOLS)[0].tolist() == want(vllm_messages(WHOLE))
    assert fmt.conversation(WHOLE, tools=TOOLS)[0].tolist() != want(WHOLE)  # the text as given differs


def test_a_template_that_concatenates_text_gets_text():
    """DeepSeek-V3's own template concatenates the arguments ('...' + arguments): transformers (and
    so vLLM) raise on object arguments. It is given text instead: a client's text as sent, an object
    as its json.dumps text (the form DeepSeek's own API returns)."""
    fmt = chat_template("deepseek_v3")
    assert CONCATENATED in source("deepseek_v3") and fmt.text_arguments
    with pytest.raises(TypeError, match="concatenate"):
        _oracle(source("deepseek_v3"), vllm_messages(WHOLE))
    assert fmt.conversation(WHOLE, tools=TOOLS)[0].tolist() == _oracle(source("deepseek_v3"), WHOLE)
    objects = vllm_messages(WHOLE)
    dumped = copy.deepcopy(objects)
    for c in dumped[2]["tool_calls"]:
        c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
    assert fmt.conversation(objects, tools=TOOLS)[0].tolist() == _oracle(source("deepseek_v3"), dumped)


def test_template_messages_follows_vllms_rule():
    """Hand-worked cases of vLLM's `_postprocess_messages` (and where this differs: text that is no
    JSON object stays text, which vLLM replaces by {} or refuses)."""
    args = ['{"a":1}', "", None, "not json", "[1, 2]", {"b": 2}]
    calls = [_call(f"c{i}", "t", a) for i, a in enumerate(args)]
    messages = [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "user", "content": "u", "tool_calls": [_call("u", "t", '{"a":1}')]},  # not an assistant's
    ]
    before = copy.deepcopy(messages)
    out = template_messages(messages)
    want: list = [{"a": 1}, {}, {}, "not json", "[1, 2]", {"b": 2}]
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == want
    assert out[1] == {"role": "assistant", "content": "x"}  # an empty tool_calls list is dropped
    assert out[2] == messages[2]
    as_text = template_messages(messages, text_arguments=True)
    want = ['{"a":1}', "{}", "{}", "not json", "[1, 2]", '{"b": 2}']
    assert [c["function"]["arguments"] for c in as_text[0]["tool_calls"]] == want
    assert messages == before  # not modified

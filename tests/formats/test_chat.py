"""Chat template and SFT loss mask (hand-worked), make-sft on fixture tasks, and chat-format batches."""

import json

import numpy as np
import pytest
from support.datahelpers import FIXTURES

from composer_jax.cli import main as cli_main
from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig
from composer_jax.data.pipeline import make_train_iterator
from composer_jax.data.sft import make_sft
from composer_jax.formats.chatml import (
    parse_assistant,
    render_chat,
    render_chat_text,
    render_continuation,
    render_prompt,
)

CONV = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {
        "role": "assistant",
        "content": "A",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "x.py"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)\n"},
    {"role": "assistant", "content": "done"},
]


def test_render_chat_hand_worked(tok):
    e, sp = tok.encode, tok.token_id
    ims, ime, tc, tr = sp("<|im_start|>"), sp("<|im_end|>"), sp("<|tool_call|>"), sp("<|tool_result|>")
    nl = e("\n")
    call = '{"id": "c1", "name": "read_file", "arguments": {"path": "x.py"}}'
    # (piece, is_target) in template order; targets = what the model emits in its turns
    pieces = [
        ([tok.bos_id], 0),
        ([ims] + e("system") + nl + e("S") + [ime] + nl, 0),
        ([ims] + e("user") + nl + e("U") + [ime] + nl, 0),
        ([ims] + e("assistant") + nl, 0),
        (e("A") + [tc] + e(call) + [ime], 1),
        (nl, 0),
        ([ims] + e("tool") + nl + [tr] + e("c1\nprint(1)\n") + [ime] + nl, 0),
        ([ims] + e("assistant") + nl, 0),
        (e("done") + [ime], 1),
        (nl, 0),
        ([tok.eos_id], 0),
    ]
    want_ids = [t for p, _ in pieces for t in p]
    want_mask = [float(m) for p, m in pieces for _ in p]
    ids, mask = render_chat(CONV, tok)
    assert ids.dtype == np.int32 and mask.dtype == np.float32
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    # the string form of the template is what the tokens decode to
    assert tok.decode(ids) == render_chat_text(CONV)
    assert tok.decode(ids[mask == 1]) == f"A<|tool_call|>{call}<|im_end|>done<|im_end|>"
    prompt = render_prompt(CONV[:2], tok)
    assert tok.decode(prompt).endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")


def test_tools_block_in_the_system_message(tok):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    ids, mask = render_chat(CONV, tok, tools=tools)
    e, sp = tok.encode, tok.token_id
    system = "S\n\n# Tools\n" + '{"name": "read_file", "parameters": {"type": "object"}}\n'
    head = [tok.bos_id, sp("<|im_start|>")] + e("system") + e("\n") + e(system) + [sp("<|im_end|>")] + e("\n")
    assert ids.tolist()[: len(head)] == head and not mask[: len(head)].any()  # never a target
    plain_ids, plain_mask = render_chat(CONV, tok)
    assert ids[mask == 1].tolist() == plain_ids[plain_mask == 1].tolist()
    assert tok.decode(ids) == render_chat_text(CONV, tools)
    for bad, message in [
        ({"type": "function"}, r"tools\[0\]: expected"),
        ({"type": "function", "function": {"name": ""}}, "accepted: 1-64 of"),
        ({"type": "function", "function": {"name": "f", "parameters": "x"}}, "JSON-schema object"),
        ({"type": "function", "function": {"name": "f", "extra": 1}}, r"unknown keys \['extra'\]"),
    ]:
        with pytest.raises(DataConfigError, match=message):
            render_prompt(CONV[:2], tok, tools=[bad])
    with pytest.raises(DataConfigError, match="given twice"):
        render_prompt(CONV[:2], tok, tools=tools * 2)


def test_render_chat_errors_name_the_message(tok):
    with pytest.raises(
        DataConfigError,
        match=r"conversation message 1: role 'bot' is not accepted; "
        r"accepted: \('system', 'user', 'assistant', 'tool'\)",
    ):
        render_chat([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}], tok)
    with pytest.raises(DataConfigError, match="a tool call must be"):
        render_chat([{"role": "assistant", "tool_calls": [{"name": "f"}]}], tok)


def test_make_sft_on_fixture_tasks(tmp_path, tok):
    out = tmp_path / "sft.jsonl"
    assert make_sft(FIXTURES / "tasks", out) == 2
    convs = {c["task"]: c["messages"] for c in map(json.loads, out.read_text().splitlines())}
    fix = convs["fix-add"]
    # the instruction exactly as the environment server gives it to the agent (trailing newline kept)
    assert fix[1] == {"role": "user", "content": (FIXTURES / "tasks/fix-add/instruction.md").read_text()}
    assert fix[1]["content"].startswith("Fix `add` in calc/ops.py: it subtracts instead of adding.")
    read = json.loads(fix[5]["content"])  # the real file contents come back from read_file
    assert read["content"] == (FIXTURES / "tasks/fix-add/environment/app/calc/ops.py").read_text()
    edit = json.loads(fix[6]["tool_calls"][0]["function"]["arguments"])
    assert edit == {"path": "calc/ops.py", "old_string": "    return a - b\n", "new_string": "    return a + b\n"}
    docs = convs["add-docs"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in docs[6]["tool_calls"]]
    assert calls == [
        ("edit_file", {"path": "CHANGELOG.md", "new_string": "# Changelog\n\n## 0.1.0\n- first release\n"}),
        ("run_shell", {"command": 'rm -- "TODO.txt"'}),
    ]
    for messages in convs.values():
        ids, mask = render_chat(messages, tok)
        assert 0 < mask.sum() < len(ids)
    # the fixture trees themselves are untouched (solve.sh ran on a copy)
    assert "a - b" in (FIXTURES / "tasks/fix-add/environment/app/calc/ops.py").read_text()
    assert (FIXTURES / "tasks/add-docs/environment/app/TODO.txt").exists()


def test_make_sft_cli_reports_failing_solution(tmp_path, capsys):
    assert (
        cli_main(["data", "make-sft", "--tasks", str(FIXTURES / "broken_tasks"), "--out", str(tmp_path / "o.jsonl")])
        == 2
    )
    assert "task 'broken': solution/solve.sh exited 3: failing" in capsys.readouterr().err


def test_chat_batches_mask_only_assistant_tokens(tmp_path, tok, tok_dir):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": CONV}) + "\n" for _ in range(3)))
    cfg = DataConfig(
        sources=(SourceConfig(type="jsonl", path=str(f)),), tokenizer=tok_dir, format="chat", eval_fraction=0.0
    )
    b = next(make_train_iterator(cfg, seq_len=256, batch_size=1, seed=0))
    ids, mask = render_chat(CONV, tok)
    row_tokens, row_mask, seg = b["tokens"][0], b["loss_mask"][0], b["segment_ids"][0]
    assert int(seg.max()) == 3  # three copies packed in one row
    for s in (1, 2, 3):
        assert row_tokens[seg == s].tolist() == ids.tolist()
        assert row_mask[seg == s].tolist() == mask.tolist()


def test_parse_assistant_inverts_the_template(tok):
    """The assistant tokens render_chat emits parse back to the message (ids kept, arguments as JSON)."""
    ids, mask = render_chat(CONV[:3], tok)
    turn = parse_assistant(ids[mask == 1], tok)
    assert turn.finished and turn.malformed == []
    assert turn.content == "A"
    assert turn.tool_calls == CONV[2]["tool_calls"]
    assert turn.message() == {"role": "assistant", "content": "A", "tool_calls": CONV[2]["tool_calls"]}


def test_parse_assistant_several_calls_and_malformed(tok):
    e, tc, ime = tok.encode, tok.token_id("<|tool_call|>"), tok.token_id("<|im_end|>")
    gen = (
        e("look")
        + [tc] + e('{"name": "list_dir", "arguments": {"path": "."}}')
        + [tc] + e('{"name": "grep", "arguments": {"pattern": "x"')  # unclosed object
        + [tc] + e('["read_file"]')  # not an object
        + [tc] + e('{"name": "run_shell", "arguments": "{\\"command\\": \\"ls\\"}"} trailing')
        + [tc] + e('{"id": "mine", "name": "read_file", "arguments": {"path": "a<|tool_call|>b"}}')
        + [ime]
        + e("ignored after the stop token")
    )  # fmt: skip
    turn = parse_assistant(gen, tok, call_id_prefix="t3")
    assert turn.finished and turn.content == "look"
    # ids default to prefix_index, index counting every call of the turn (malformed ones too)
    assert [c["id"] for c in turn.tool_calls] == ["t3_0", "mine"]
    assert turn.tool_calls[0]["function"] == {"name": "list_dir", "arguments": '{"path": "."}'}
    # a string that mentions the special token is text, not a call boundary
    assert json.loads(turn.tool_calls[1]["function"]["arguments"]) == {"path": "a<|tool_call|>b"}
    assert len(turn.malformed) == 3
    assert turn.malformed[0].startswith("tool call 1: not valid JSON")
    assert turn.malformed[1].startswith('tool call 2: expected an object with a string "name"')
    assert turn.malformed[2].startswith("tool call 3: text after the JSON object")


def test_parse_assistant_cut_off(tok):
    e, tc = tok.encode, tok.token_id("<|tool_call|>")
    turn = parse_assistant(e("hi") + [tc] + e('{"name": "list_dir", "arguments": {}}'), tok)
    assert not turn.finished and turn.tool_calls == []
    assert turn.malformed == ["tool call 0: cut off by the token budget before <|im_end|>"]
    plain = parse_assistant(e("no calls, no stop"), tok)
    assert (plain.content, plain.tool_calls, plain.malformed, plain.finished) == ("no calls, no stop", [], [], False)
    assert plain.message() == {"role": "assistant", "content": "no calls, no stop"}


def test_render_continuation_extends_a_prompt_exactly(tok):
    """prompt + the assistant's tokens + continuation == the template's rendering of the whole
    conversation up to the next generation prompt (when the turn tokenises the same way)."""
    ids, mask = render_chat(CONV[:3], tok)
    turn = ids[mask == 1].tolist()
    got = render_prompt(CONV[:2], tok).tolist() + turn + render_continuation(CONV[3:4], tok).tolist()
    assert got == render_prompt(CONV[:4], tok).tolist()

"""Tool-call syntaxes (formats/tool_calls.py) against vLLM's own parsers, and by hand.

The oracle is vLLM's `extract_tool_calls` (hermes, qwen3_coder, deepseek_v3, kimi_k2), run by
tests/support/vllm_tool_oracle.py under vLLM's python; its answers on the corpus
(tests/support/tool_call_corpus.py) are recorded in tests/fixtures/tool_calls/vllm_oracle.json,
which the default tests read; the slow test regenerates them live and checks the record is current.

Agreement on a case: the same content (None and "" are the same), the same function names in order,
the same arguments parsed as JSON objects, the same ids where the text carries them (kimi_k2), and
no broken call on our side. Where they differ on purpose, DIFFERENCES says how and why, and the test
checks both sides of the difference: that vLLM still answers what the entry says, and our answer.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from composer_jax.errors import ConfigError
from composer_jax.formats.chatml import parse_assistant, render_chat_text
from composer_jax.formats.tool_calls import TOOL_CALL_SYNTAXES, parse_turn, tool_call_syntax

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
FIXTURE = ROOT / "tests" / "fixtures" / "tool_calls" / "vllm_oracle.json"
VLLM_PYTHON = ROOT / ".venv" / "vllm" / "bin" / "python"
sys.path.insert(0, str(SUPPORT))
from tool_call_corpus import TOOLS, cases  # noqa: E402

# (syntax, case) -> (what vLLM does, our calls that parse, our broken calls). The reason for each kind:
#  gives_up: vLLM drops every call of a turn where one call's JSON is bad and returns the whole text
#    as content; a turn's good calls still run here and the bad one is an error observation, so
#    the policy pays for exactly the call it broke (chatml does the same).
#  keeps_unclosed: vLLM accepts a call its end marker never closed (at the end of the text); here it
#    is broken: the model did not finish the syntax, and a call cut off by the token budget would
#    otherwise run with whatever arguments it had reached.
#  keeps_bad_arguments: vLLM returns a call whose arguments string is not JSON; here it is broken
#    (the agent loop could not run it either; it is counted either way, here at parse time).
#  drops_bad_parameter: vLLM's qwen3_coder skips a malformed <parameter= tag and runs the call
#    without it; here the call is broken, since running it with an argument missing is a guess.
#  drops_call: vLLM returns no call and no error for an unclosed or unparseable call; here it is a
#    broken call, so the model sees why nothing ran.
DIFFERENCES: dict[tuple[str, str], tuple[str, int, int]] = {
    ("hermes", "malformed"): ("gives_up", 1, 1),
    ("hermes", "unterminated"): ("keeps_unclosed", 0, 1),
    ("hermes", "truncated_mid_argument"): ("gives_up", 0, 1),
    ("qwen3_coder", "malformed"): ("drops_bad_parameter", 0, 1),
    ("qwen3_coder", "no_function_tag"): ("drops_call", 0, 1),
    ("qwen3_coder", "unterminated"): ("keeps_unclosed", 0, 1),
    ("qwen3_coder", "truncated_mid_argument"): ("drops_bad_parameter", 0, 1),
    ("deepseek_v3", "malformed"): ("keeps_bad_arguments", 1, 1),
    ("deepseek_v3", "unterminated"): ("drops_call", 0, 1),
    ("deepseek_v3", "truncated_mid_argument"): ("drops_call", 0, 1),
    ("kimi_k2", "malformed"): ("keeps_bad_arguments", 1, 1),
    ("kimi_k2", "unterminated"): ("keeps_unclosed", 0, 1),
    ("kimi_k2", "truncated_mid_argument"): ("keeps_bad_arguments", 0, 1),
}


def _json_object(s: str) -> dict | None:
    try:
        value = json.loads(s)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _calls(turn) -> list[tuple[str, dict | None]]:
    return [(c["function"]["name"], _json_object(c["function"]["arguments"])) for c in turn.tool_calls]


def _vllm_calls(out: dict) -> list[tuple[str, dict | None]]:
    return [(c["name"], _json_object(c["arguments"])) for c in out["tool_calls"]]


def agrees(case: dict, turn, out: dict) -> bool:
    """The definition of agreement (module docstring)."""
    ids_carried = [c["id"] for c in out["tool_calls"] if c.get("id")]
    return (
        "error" not in out
        and (turn.content or None) == (out["content"] or None)
        and _calls(turn) == _vllm_calls(out)
        and all(args is not None for _, args in _calls(turn))
        and not turn.malformed
        and (not ids_carried or [c["id"] for c in turn.tool_calls] == ids_carried)
    )


def _differs_as_documented(case: dict, turn, out: dict) -> None:
    kind, n_ok, n_broken = DIFFERENCES[(case["syntax"], case["name"])]
    assert (len(turn.tool_calls), len(turn.malformed)) == (n_ok, n_broken), turn
    vllm = _vllm_calls(out)
    if kind == "gives_up":
        assert not out["tools_called"] and out["content"] == case["text"]
    elif kind == "keeps_unclosed":
        assert len(vllm) == n_ok + n_broken and all(a is not None for _, a in vllm)
    elif kind == "keeps_bad_arguments":
        assert sum(a is None for _, a in vllm) == n_broken
    elif kind == "drops_bad_parameter":
        assert len(vllm) == 1 and vllm[0][1] == {}
    else:
        assert kind == "drops_call" and vllm == []
    if kind == "keeps_unclosed":  # the unclosed call is the last one
        assert _calls(turn) == vllm[:n_ok]
    elif kind in ("keeps_bad_arguments", "drops_call"):  # the rest: vLLM's calls with JSON-object arguments
        assert _calls(turn) == [(n, a) for n, a in vllm if a is not None]
    assert (turn.content or None) == (None if kind == "gives_up" else out["content"] or None)


def _check_against(outputs: list[dict], corpus: list[dict]) -> None:
    assert len(outputs) == len(corpus)
    for case, out in zip(corpus, outputs, strict=True):
        turn = parse_turn(case["syntax"], case["text"], tools=TOOLS if case["tools"] else None)
        if (case["syntax"], case["name"]) in DIFFERENCES:
            assert not agrees(case, turn, out), (
                f"{case['syntax']}/{case['name']} now agrees: drop its DIFFERENCES entry"
            )
            _differs_as_documented(case, turn, out)
        else:
            assert agrees(case, turn, out), (case["syntax"], case["name"], turn, out)


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_fixture_records_the_current_corpus(recorded):
    """A corpus edit without `vllm_tool_oracle.py --write` would leave the record stale."""
    assert recorded["cases"] == cases()


def test_agrees_with_recorded_vllm(recorded):
    _check_against(recorded["outputs"], recorded["cases"])
    assert {s for s, _ in DIFFERENCES} | {c["syntax"] for c in recorded["cases"]} == set(TOOL_CALL_SYNTAXES) - {
        "composer-chatml-v1"
    }


@pytest.mark.parametrize(
    "perturb",
    [
        lambda o: o["tool_calls"][0].update(name="shel"),
        lambda o: o["tool_calls"][0].update(arguments='{"cmd": "ls -l"}'),
        lambda o: o.update(content="Let me look"),
        lambda o: o["tool_calls"].pop(),
    ],
)
def test_agreement_rejects_a_perturbed_vllm_answer(recorded, perturb):
    """The comparison can fail: a changed name, argument, content or a lost call is a disagreement."""
    i = next(i for i, c in enumerate(recorded["cases"]) if (c["syntax"], c["name"]) == ("hermes", "content_before"))
    case, out = recorded["cases"][i], json.loads(json.dumps(recorded["outputs"][i]))
    turn = parse_turn("hermes", case["text"], tools=TOOLS)
    assert agrees(case, turn, out)
    perturb(out)
    assert not agrees(case, turn, out)


@pytest.mark.slow
def test_live_vllm_matches_the_record(recorded):
    """Runs vLLM's parsers (about 20 s to import vLLM). The default tests
    test_agrees_with_recorded_vllm and test_fixture_records_the_current_corpus keep the property
    against the recorded answers."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM interpreter at .venv/vllm/bin/python ({VLLM_PYTHON}): the live oracle cannot run")
    corpus = cases()
    done = subprocess.run(
        [str(VLLM_PYTHON), str(SUPPORT / "vllm_tool_oracle.py")],
        input=json.dumps(corpus),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    live = json.loads(done.stdout)
    assert live == recorded["outputs"], "vLLM's answers changed: rerun tests/support/vllm_tool_oracle.py --write"
    _check_against(live, corpus)


# ---------------------------------------------------------------------- by hand, without vLLM
def _fn(turn) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in turn.tool_calls]


def test_hermes_by_hand():
    text = 'ok<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n[1]\n</tool_call>'
    turn = parse_turn("hermes", text, call_id_prefix="t")
    assert (turn.content, _fn(turn), [c["id"] for c in turn.tool_calls]) == ("ok", [("a", '{"x": 1}')], ["t_0"])
    assert turn.malformed == ["tool call 1: expected an object with a string \"name\", got '[1]'"]
    assert turn.message() == {"role": "assistant", "content": "ok", "tool_calls": turn.tool_calls}


def test_qwen3_coder_by_hand_converts_by_schema():
    text = (
        "Sure.\n<tool_call>\n<function=edit>\n<parameter=path>\na b\n</parameter>\n"
        "<parameter=line>\n12\n</parameter>\n<parameter=dry>\nFalse\n</parameter>\n"
        "<parameter=ratio>\n2\n</parameter>\n<parameter=opts>\nnot json\n</parameter>\n</function>\n</tool_call>"
    )
    turn = parse_turn("qwen3_coder", text, tools=TOOLS)
    assert turn.content == "Sure." and not turn.malformed
    # integer 12, boolean False (any case), number 2 kept an int (no "."), object that does not parse stays text
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {
        "path": "a b", "line": 12, "dry": False, "ratio": 2, "opts": "not json",
    }  # fmt: skip
    as_text = json.loads(parse_turn("qwen3_coder", text).tool_calls[0]["function"]["arguments"])
    assert as_text["line"] == "12" and as_text["dry"] == "False"


def test_deepseek_v3_by_hand():
    text = (
        'x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\n  "a": [1]\n}\n```'
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>mystery<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>"
    )
    turn = parse_turn("deepseek_v3", text)
    # arguments over several lines parse here (vLLM's single-line regex would drop this call)
    assert (turn.content, _fn(turn)) == ("x", [("f", '{"a": [1]}')])
    assert len(turn.malformed) == 1 and turn.malformed[0].startswith("tool call 1: expected function")
    empty = parse_turn("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>")
    assert empty.malformed == ["tool call 0: a tool-calls section with no call in it"]


def test_kimi_k2_by_hand_keeps_the_text_id():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.read:3<|tool_call_argument_begin|>"
        '{"p": "é"}<|tool_call_end|><|tool_call_begin|>functions.cut<|tool_call_argument_begin|>{}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    turn = parse_turn("kimi_k2", text)
    assert turn.tool_calls == [
        {"id": "functions.read:3", "type": "function", "function": {"name": "read", "arguments": '{"p": "é"}'}}
    ]
    assert len(turn.malformed) == 1 and turn.malformed[0].startswith("tool call 1: expected functions.NAME:IDX")


def test_cut_off_turn_says_so():
    text = '<tool_call>\n{"name": "a", "arguments": {"x": '
    assert parse_turn("hermes", text, finished=False).malformed == [
        "tool call 0: cut off by the token budget before the call was closed"
    ]
    assert parse_turn("hermes", text).malformed[0].startswith("tool call 0: not closed by </tool_call>")
    closed = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    assert _fn(parse_turn("hermes", closed, finished=False)) == [("a", "{}")]


@pytest.mark.parametrize("syntax", ["deepseek_v3", "kimi_k2"])
def test_turn_cut_right_after_the_tool_calls_opening_says_so(syntax):
    """max_tokens ending the turn just after the section's opening is the budget's doing, not an
    empty section the model wrote (which a finished turn still reports as one)."""
    opening = TOOL_CALL_SYNTAXES[syntax].start_markers[0]
    cut = parse_turn(syntax, "Let me look." + opening, finished=False)
    assert (cut.content, cut.tool_calls) == ("Let me look.", [])
    assert cut.malformed == [f"tool call 0: cut off by the token budget right after the tool-calls opening {opening}"]
    assert parse_turn(syntax, "Let me look." + opening).malformed == [
        "tool call 0: a tool-calls section with no call in it"
    ]


def test_chatml_delegates_and_matches_the_token_parser(tok):
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "list_dir", "arguments": '{"path": "."}'}},
        {"id": "c2", "type": "function", "function": {"name": "grep", "arguments": '{"pattern": "ü"}'}},
    ]
    rendered = render_chat_text(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "A", "tool_calls": calls}]
    )
    text = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    by_text = parse_turn("composer-chatml-v1", text)
    tc, pieces = tok.token_id("<|tool_call|>"), text.split("<|tool_call|>")
    ids = tok.encode(pieces[0]) + [t for p in pieces[1:] for t in [tc, *tok.encode(p)]]
    by_tokens = parse_assistant([*ids, tok.token_id("<|im_end|>")], tok)
    assert by_text == by_tokens and by_text.tool_calls == calls and by_text.content == "A"
    cut = parse_turn("composer-chatml-v1", text, finished=False)
    assert cut.malformed == ["tool call 1: cut off by the token budget before <|im_end|>"]


@pytest.mark.parametrize("syntax", sorted(TOOL_CALL_SYNTAXES))
def test_start_markers_begin_the_calls(syntax):
    """Content is exactly the text before the first start marker (what a streamer sends as content)."""
    ts = tool_call_syntax(syntax)
    text = "plain text " + ts.start_markers[0] + "anything"
    turn = parse_turn(syntax, text)
    assert turn.content.rstrip() == "plain text" and len(turn.tool_calls) + len(turn.malformed) >= 1
    assert parse_turn(syntax, "plain text").malformed == []


@pytest.mark.parametrize("syntax", ["hermes", "qwen3_coder", "deepseek_v3", "kimi_k2"])
def test_end_markers_close_each_call(syntax):
    """The text up to the first call's end marker reads as that call alone (what a streamer sends)."""
    from tool_call_corpus import WRITERS

    text = WRITERS[syntax](("shell", {"cmd": "ls"}), ("edit", {"path": "a"}))
    end = tool_call_syntax(syntax).end_markers[0]
    first = parse_turn(syntax, text[: text.index(end) + len(end)])
    assert _fn(first) == [("shell", '{"cmd": "ls"}')] and first.malformed == []
    assert _fn(parse_turn(syntax, text))[1] == ("edit", '{"path": "a"}')


def test_unknown_syntax_names_it_and_the_accepted():
    with pytest.raises(ConfigError, match=r"'hermes2'.*accepted: \['composer-chatml-v1', 'deepseek_v3', 'hermes'"):
        parse_turn("hermes2", "x")

"""Tool calls in a model's own syntax: a generated assistant turn's text -> `AssistantTurn`.

One parser per syntax, each the inverse of how that family's chat template writes an assistant
message's `tool_calls`:

  hermes              Qwen2.5 / Qwen3:  <tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>
  qwen3_coder         Qwen3-Coder XML:  <tool_call>\\n<function=N>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
                                        </function>\\n</tool_call>
  deepseek_v3         <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{..}\\n```
                      <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  kimi_k2             <|tool_calls_section_begin|><|tool_call_begin|>functions.N:IDX
                      <|tool_call_argument_begin|>{..}<|tool_call_end|>...<|tool_calls_section_end|>
  composer-chatml-v1  the project's own: {..}<|tool_call|>{"name": N, "arguments": {..}} (formats/chatml.py)

The result is what formats/chatml.py's `parse_assistant` returns for the project's format: content
(the text before the first call), OpenAI-shape calls, and one message per broken call (`malformed`),
which the agent loop shows the model as an error observation and counts as a broken tool call for
the reward. A call is broken when its body does not follow the syntax, its arguments are not a JSON
object, or it is not closed by the syntax's end marker (unterminated, or cut off mid-argument):
vLLM's parsers (the oracle, tests/formats/test_tool_calls.py) accept some of these or drop them
silently; a policy being trained must see and pay for them. Unknown function names are not judged
here: the agent loop checks names against the offered tools.

qwen3_coder's parameter values are text; with `tools`, each is converted by its type in the called
tool's JSON schema (integer, number, boolean, null, object, array), as vLLM does; without a schema
for it, a value stays a string.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from composer_jax.errors import ConfigError
from composer_jax.formats.chatml import AssistantTurn, parse_call_json

# a parsed call: (name, arguments as a JSON-object string, the id the text itself carries or None),
# or the message saying why the call is broken
Parsed = tuple[str, str, str | None] | str


@dataclasses.dataclass(frozen=True)
class ToolCallSyntax:
    """One tool-call syntax. start_markers: the text each call (or the calls' section) begins at,
    so a streamer knows where content ends; the first is the one a forced call opens with.
    end_markers: the text that closes one call (a streamer may parse the turn again after each);
    () where only the next call or the end of the turn closes one (composer-chatml-v1).
    split(text, tools) -> (content, one Parsed per call, in order)."""

    name: str
    start_markers: tuple[str, ...]
    end_markers: tuple[str, ...]
    split: Callable[[str, Sequence[dict] | None], tuple[str, list[Parsed]]]


def _object_args(raw: str, index: int, name: str) -> str:
    """Arguments text -> the JSON-object string OpenAI carries; ValueError when it is not one."""
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call {index} ({name}): arguments not valid JSON ({exc.msg}): {raw[:120]!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {index} ({name}): arguments must be a JSON object, got {raw[:80]!r}")
    return json.dumps(args, ensure_ascii=False)


def _closed_bodies(rest: str, begin: str, end: str) -> list[str | None]:
    """The bodies of the calls in `rest` (which starts at a `begin`), None for one not closed by `end`."""
    bodies: list[str | None] = []
    for piece in rest.split(begin)[1:]:
        bodies.append(piece[: piece.index(end)] if end in piece else None)
    return bodies


class _Unclosed(str):
    """The message for a call its syntax's end marker never closed."""


def _unclosed(index: int, end: str) -> str:
    return _Unclosed(f"tool call {index}: not closed by {end} (unterminated, or cut off mid-call)")


class _EmptySection(_Unclosed):
    """The message for a tool-calls section with no call in it: in a turn the token budget cut
    off, the budget ended right after the section's opening."""


# ------------------------------------------------------------------------------------------ hermes
def _split_hermes(text: str, tools: Sequence[dict] | None) -> tuple[str, list[Parsed]]:
    at = text.find("<tool_call>")
    if at < 0:
        return text, []
    calls: list[Parsed] = []
    for i, body in enumerate(_closed_bodies(text[at:], "<tool_call>", "</tool_call>")):
        if body is None:
            calls.append(_unclosed(i, "</tool_call>"))
            continue
        try:
            call = parse_call_json(body, i, "")
        except ValueError as exc:
            calls.append(str(exc))
            continue
        fn = call["function"]
        try:
            calls.append((fn["name"], _object_args(fn["arguments"], i, fn["name"]), None))
        except ValueError as exc:
            calls.append(str(exc))
    return text[:at], calls


# ------------------------------------------------------------------------------------- qwen3_coder
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or ():
            types += _schema_types(choice)
    return types


def _convert(raw: str, types: list[str]) -> Any:
    """A parameter's text by its schema types, first that fits; the text itself when none does."""
    for t in types:
        try:
            if t == "integer":
                return int(raw)
            if t == "number":
                x = float(raw)
                if x == x and abs(x) != float("inf"):
                    return int(x) if x.is_integer() and "." not in raw and "e" not in raw.lower() else x
            if t == "boolean" and raw.strip().lower() in ("true", "false"):
                return raw.strip().lower() == "true"
            if t == "null" and raw.strip() == "null":
                return None
            if t in ("object", "array"):
                value = json.loads(raw)
                if isinstance(value, dict if t == "object" else list):
                    return value
        except ValueError:
            continue
    return raw


def _qwen3_call(body: str, index: int, tools: Sequence[dict] | None) -> Parsed:
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return f"tool call {index}: expected <function=NAME>...</function> inside <tool_call>, got {body[:120]!r}"
    name, inner = m.group(1).strip(), m.group(2)
    if _PARAMETER.sub("", inner).strip():
        bad = _PARAMETER.sub("", inner).strip()
        return f"tool call {index} ({name}): text outside <parameter=P>...</parameter>: {bad[:120]!r}"
    schema: dict = next((t["function"] for t in tools or () if t.get("function", {}).get("name") == name), {})
    props = (schema.get("parameters") or {}).get("properties") or {}
    args = {p.strip(): _convert(v, _schema_types(props.get(p.strip()))) for p, v in _PARAMETER.findall(inner)}
    return name, json.dumps(args, ensure_ascii=False), None


def _split_qwen3_coder(text: str, tools: Sequence[dict] | None) -> tuple[str, list[Parsed]]:
    at = text.find("<tool_call>")
    if at < 0:
        return text, []
    calls: list[Parsed] = []
    for i, body in enumerate(_closed_bodies(text[at:], "<tool_call>", "</tool_call>")):
        calls.append(_unclosed(i, "</tool_call>") if body is None else _qwen3_call(body, i, tools))
    # the template's newline(s) before <tool_call> are framing, not content (vLLM strips them too)
    return text[:at].rstrip(), calls


# ------------------------------------------------------------------------------- deepseek, kimi
_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_BODY = re.compile(r"(\w+)" + _DS_SEP + r"([^\n]+)\n```json\n(.*)\n```\s*", re.DOTALL)
_KIMI_BEGIN, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL, _KIMI_CALL_END, _KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_KIMI_BODY = re.compile(r"\s*((?:functions\.)?([^:<\s]+):\d+)" + re.escape(_KIMI_ARGS) + r"(.*)", re.DOTALL)


def _deepseek_call(body: str, index: int) -> Parsed:
    m = _DS_BODY.fullmatch(body.strip("\n"))
    if m is None or m.group(1) != "function":
        return f"tool call {index}: expected function{_DS_SEP}NAME\\n```json\\n{{...}}\\n``` , got {body[:120]!r}"
    name = m.group(2).strip()
    try:
        return name, _object_args(m.group(3), index, name), None
    except ValueError as exc:
        return str(exc)


def _kimi_call(body: str, index: int) -> Parsed:
    m = _KIMI_BODY.fullmatch(body)
    if m is None:
        return f"tool call {index}: expected functions.NAME:IDX{_KIMI_ARGS}{{...}}, got {body[:120]!r}"
    try:
        return m.group(2), _object_args(m.group(3), index, m.group(2)), m.group(1)
    except ValueError as exc:
        return str(exc)


def _sectioned(begin: str, call: str, call_end: str, one: Callable[[str, int], Parsed]):
    def split(text: str, tools: Sequence[dict] | None) -> tuple[str, list[Parsed]]:
        at = text.find(begin)
        if at < 0:
            return text, []
        bodies = _closed_bodies(text[at:], call, call_end)
        calls = [_unclosed(i, call_end) if b is None else one(b, i) for i, b in enumerate(bodies)]
        return text[:at], calls or [_EmptySection("tool call 0: a tool-calls section with no call in it")]

    return split


# ---------------------------------------------------------------------------- composer-chatml-v1
_CHATML = "composer-chatml-v1"


def _split_chatml(text: str, tools: Sequence[dict] | None) -> tuple[str, list[Parsed]]:
    content, *pieces = text.split("<|tool_call|>")
    calls: list[Parsed] = []
    for i, piece in enumerate(pieces):
        try:
            call = parse_call_json(piece, i, "")
        except ValueError as exc:
            calls.append(str(exc))
            continue
        calls.append((call["function"]["name"], call["function"]["arguments"], call["id"] or None))
    return content, calls


TOOL_CALL_SYNTAXES: dict[str, ToolCallSyntax] = {
    s.name: s
    for s in (
        ToolCallSyntax("hermes", ("<tool_call>",), ("</tool_call>",), _split_hermes),
        ToolCallSyntax("qwen3_coder", ("<tool_call>",), ("</tool_call>",), _split_qwen3_coder),
        ToolCallSyntax(
            "deepseek_v3", (_DS_BEGIN,), (_DS_CALL_END,), _sectioned(_DS_BEGIN, _DS_CALL, _DS_CALL_END, _deepseek_call)
        ),
        ToolCallSyntax(
            "kimi_k2",
            (_KIMI_BEGIN,),
            (_KIMI_CALL_END,),
            _sectioned(_KIMI_BEGIN, _KIMI_CALL, _KIMI_CALL_END, _kimi_call),
        ),
        ToolCallSyntax(_CHATML, ("<|tool_call|>",), (), _split_chatml),
    )
}


def tool_call_syntax(name: str) -> ToolCallSyntax:
    """The syntax called `name`; ConfigError naming it and the accepted names otherwise."""
    if name not in TOOL_CALL_SYNTAXES:
        raise ConfigError(f"tool-call syntax {name!r} is not known; accepted: {sorted(TOOL_CALL_SYNTAXES)}")
    return TOOL_CALL_SYNTAXES[name]


def parse_turn(
    syntax: str,
    text: str,
    *,
    call_id_prefix: str = "call",
    tools: Sequence[dict] | None = None,
    finished: bool = True,
) -> AssistantTurn:
    """One generated assistant turn's text (its stop token removed) in `syntax` -> AssistantTurn.

    Calls get the id their text carries (kimi_k2's `functions.N:IDX`, a chatml "id") or
    f"{call_id_prefix}_{i}" (i counts this turn's calls, broken ones included, as chatml does).
    tools: the request's OpenAI function tools (qwen3_coder converts parameter values by them).
    finished: False when the turn was cut off by the token budget; then a last call the text leaves
    open says so (composer-chatml-v1: the last call, which only the end of turn closes)."""
    content, parsed = tool_call_syntax(syntax).split(text, tools)
    calls: list[dict] = []
    malformed: list[str] = []
    for i, p in enumerate(parsed):
        open_at_cut = not finished and i == len(parsed) - 1 and (syntax == _CHATML or isinstance(p, _Unclosed))
        if open_at_cut and isinstance(p, _EmptySection):
            opening = tool_call_syntax(syntax).start_markers[0]
            malformed.append(f"tool call {i}: cut off by the token budget right after the tool-calls opening {opening}")
        elif open_at_cut:
            closer = "<|im_end|>" if syntax == _CHATML else "the call was closed"
            malformed.append(f"tool call {i}: cut off by the token budget before {closer}")
        elif isinstance(p, str):
            malformed.append(p)
        else:
            name, args, given_id = p
            fn = {"name": name, "arguments": args}
            calls.append({"id": given_id or f"{call_id_prefix}_{i}", "type": "function", "function": fn})
    return AssistantTurn(content, calls, malformed, finished)

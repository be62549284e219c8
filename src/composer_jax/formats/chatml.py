"""Chat template ("composer-chatml-v1") and the SFT loss mask.

A conversation is a list of OpenAI-style messages:
  {"role": "system" | "user", "content": str}     ("developer", OpenAI's newer name for system, is
                                                   accepted and rendered as "system")
  {"role": "assistant", "content": str | None,
   "tool_calls": [{"id": str, "type": "function", "function": {"name": str, "arguments": str(JSON)}}]}
  {"role": "tool", "tool_call_id": str, "content": str}

It is rendered as (spaces added here for reading; `\\n` is a newline):

  <|bos|>
  <|im_start|>system\\n{content}<|im_end|>\\n
  <|im_start|>user\\n{content}<|im_end|>\\n
  <|im_start|>assistant\\n{content}<|tool_call|>{"id": .., "name": .., "arguments": {..}}<|im_end|>\\n
  <|im_start|>tool\\n<|tool_result|>{tool_call_id}\\n{content}<|im_end|>\\n
  ...
  <|eos|>

With function tools (the OpenAI request's `tools`), a tools block goes at the end of the first
system message (after a blank line when it has content; a system message holding only the block
is put first when the conversation has none):

  # Tools\n
  {"name": .., "description": .., "parameters": {..}}\n     (one line per tool, in the given order)

Tool-call arguments are embedded as the parsed JSON object (compact, keys in the order given) when
the `arguments` string parses, else as the raw string. Every tool call is one `<|tool_call|>`
followed by one JSON object; the next `<|tool_call|>` or `<|im_end|>` ends it.

Loss mask (1.0 = a target the model is trained to produce): exactly the tokens the model emits in
an assistant turn: its content, its tool calls and the turn's closing `<|im_end|>` (the stop token
at inference). Never the `<|im_start|>assistant\\n` header (the prompt supplies it), the newline
after `<|im_end|>`, BOS/EOS, or any system, user or tool-result token.

Pieces are tokenized separately and concatenated, so the mask is exact at token level and the same
function renders inference prompts (`render_prompt`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from composer_jax.config.data import DataConfigError
from composer_jax.env.api.protocol import ToolArgumentError, decode_arguments
from composer_jax.formats.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role (o1 and later)


def _role(m: Any) -> Any:
    """A message's role as the template renders it (aliases resolved); the raw value otherwise."""
    role = m.get("role") if isinstance(m, dict) else None
    return ROLE_ALIASES.get(role, role) if isinstance(role, str) else role


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise DataConfigError(
                    f"{where}: content part {p!r} is not accepted; accepted: a string or "
                    '[{"type": "text", "text": ...}]'
                )
        return "".join(parts)
    raise DataConfigError(
        f"{where}: content must be a string, null or a list of text parts, got {type(content).__name__}"
    )


def tool_call_json(call: dict, where: str) -> str:
    """One OpenAI tool call -> the JSON text placed after <|tool_call|>."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise DataConfigError(
            f"{where}: a tool call must be "
            '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}, '
            f"got {call!r}"
        )
    args = fn.get("arguments", "{}")
    try:  # the server's reading of the arguments string (blank means none)
        args = decode_arguments(args, where, tool=fn["name"])
    except ToolArgumentError:
        pass  # keep the raw string: the model should still learn what was emitted
    obj = {"id": call["id"]} if call.get("id") else {}
    obj.update(name=fn["name"], arguments=args)
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


TOOL_KEYS = ("name", "description", "parameters")


def check_tools(tools: Any, where: str = "tools") -> list[dict]:
    """OpenAI function tools -> their `function` objects ({"name", "description"?, "parameters"?}).

    Accepted: a list of {"type": "function", "function": {"name": non-empty string of letters,
    digits, _ and - (at most 64), "description": string, "parameters": JSON-schema object,
    "strict": bool}}; names unique. Raises DataConfigError naming the bad entry."""
    if not isinstance(tools, (list, tuple)):
        raise DataConfigError(f"{where}: must be a list of tools, got {type(tools).__name__}")
    out: list[dict] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise DataConfigError(
                f'{at}: expected {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}, '
                f"got {t!r:.200}"
            )
        fn = t["function"]
        name = fn.get("name")
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= 64
            or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
        ):
            raise DataConfigError(f"{at}.function.name: {name!r} is not accepted; accepted: 1-64 of a-z A-Z 0-9 _ -")
        if name in seen:
            raise DataConfigError(f"{at}.function.name: {name!r} is given twice; tool names must be unique")
        seen.add(name)
        unknown = sorted(set(fn) - {*TOOL_KEYS, "strict"})
        if unknown:
            raise DataConfigError(f"{at}.function: unknown keys {unknown}; accepted: {[*TOOL_KEYS, 'strict']}")
        if "description" in fn and not isinstance(fn["description"], str):
            raise DataConfigError(f"{at}.function.description must be a string, got {fn['description']!r:.80}")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise DataConfigError(
                f"{at}.function.parameters must be a JSON-schema object, got {fn['parameters']!r:.80}"
            )
        out.append({k: fn[k] for k in TOOL_KEYS if k in fn})
    return out


def tools_block(tools: Sequence[dict]) -> str:
    """The text the template appends to the system message for function tools (module docstring)."""
    lines = [json.dumps(fn, ensure_ascii=False, separators=(", ", ": ")) for fn in check_tools(tools)]
    return "# Tools\n" + "".join(line + "\n" for line in lines)


def _with_tools(messages: Sequence[dict], tools: Sequence[dict] | None, where: str) -> Sequence[dict]:
    if not tools:
        return messages
    block = tools_block(tools)
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        first = messages[0]
        if _role(first) == "system":
            text = _content_text(first.get("content"), f"{where} message 0")
            return [{**first, "content": f"{text}\n\n{block}" if text else block}, *messages[1:]]
    if not isinstance(messages, (list, tuple)):
        return messages  # _render reports it
    return [{"role": "system", "content": block}, *messages]


def _render(messages: Sequence[dict], tok: Tokenizer, *, where: str, generation_prompt: bool, bos: bool = True):
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    tool_call, tool_result = tok.token_id("<|tool_call|>"), tok.token_id("<|tool_result|>")
    newline = tok.encode("\n")
    ids: list[int] = [tok.bos_id] if bos else []
    mask: list[float] = [0.0] if bos else []

    def add(piece: list[int], target: bool) -> None:
        ids.extend(piece)
        mask.extend([1.0 if target else 0.0] * len(piece))

    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataConfigError(f"{where}: a conversation must be a non-empty list of messages")
    for i, m in enumerate(messages):
        at = f"{where} message {i}"
        role = _role(m)
        if role not in ROLES:
            given = m.get("role") if isinstance(m, dict) else None
            raise DataConfigError(
                f"{at}: role {given!r} is not accepted; accepted: {ROLES} (and 'developer', rendered as 'system')"
            )
        add([im_start] + tok.encode(role) + newline, False)
        text = _content_text(m.get("content"), at)
        if role == "assistant":
            add(tok.encode(text) if text else [], True)
            for call in m.get("tool_calls") or ():
                add([tool_call] + tok.encode(tool_call_json(call, at)), True)
            add([im_end], True)
            add(newline, False)
        elif role == "tool":
            call_id = m.get("tool_call_id") or ""
            add([tool_result] + tok.encode(f"{call_id}\n{text}") + [im_end] + newline, False)
        else:
            add((tok.encode(text) if text else []) + [im_end] + newline, False)
    if generation_prompt:
        add([im_start] + tok.encode("assistant") + newline, False)
    else:
        add([tok.eos_id], False)
    return np.asarray(ids, np.int32), np.asarray(mask, np.float32)


def render_chat(
    messages: Sequence[dict], tok: Tokenizer, *, where: str = "conversation", tools: Sequence[dict] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A whole conversation -> (tokens: int32[n], loss_mask: float32[n]) for SFT.

    loss_mask[i] = 1.0 where tokens[i] is an assistant-emitted token (see module docstring).
    `where` prefixes error messages (e.g. "train.jsonl:12"). tools: OpenAI function tools, rendered
    into the system message (module docstring)."""
    return _render(_with_tools(messages, tools, where), tok, where=where, generation_prompt=False)


CHAT_FORMAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|tool_call|>", "<|tool_result|>")


def missing_chat_tokens(tok: Tokenizer) -> list[str]:
    """The chat format's special tokens `tok` lacks (a converted DeepSeek / Kimi tokenizer lacks all)."""
    return [t for t in CHAT_FORMAT_TOKENS if t not in tok.special]


def chat_unavailable(tok: Tokenizer) -> str | None:
    """Why chat cannot be rendered with `tok` (None when it can): for servers to say once, at start."""
    missing = missing_chat_tokens(tok)
    if not missing:
        return None
    return (
        f"this model's tokenizer has no {', '.join(missing)}: the project's chat format (composer-chatml-v1) "
        "needs them, so chat completions are not available; use /v1/completions with a text or token-id "
        "prompt (or a tokenizer trained with `composer-jax tokenizer train`)"
    )


def render_prompt(messages: Sequence[dict], tok: Tokenizer, *, tools: Sequence[dict] | None = None) -> np.ndarray:
    """Conversation so far + `<|im_start|>assistant\\n`: the prompt for sampling the next turn,
    which ends at `<|im_end|>`. tools: as for `render_chat`. tokens: int32[n]."""
    return _render(_with_tools(messages, tools, "prompt"), tok, where="prompt", generation_prompt=True)[0]


def render_continuation(messages: Sequence[dict], tok: Tokenizer) -> np.ndarray:
    """The tokens that follow a generated assistant turn (which ended at its `<|im_end|>`) when
    `messages` (tool results, a user message) come next: the template's newline after the turn,
    the messages, and `<|im_start|>assistant\\n`. So render_prompt(m) + generated turn +
    render_continuation(more) is the prompt of the next turn, with the model's own tokens kept
    verbatim (re-tokenising its text could split it differently). tokens: int32[n]."""
    body = _render(messages, tok, where="continuation", generation_prompt=True, bos=False)[0]
    return np.concatenate([np.asarray(tok.encode("\n"), np.int32), body])


def render_chat_text(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
    """The template as a string (for reading and docs; training uses `render_chat`)."""
    messages = _with_tools(messages, tools, "conversation")
    out = ["<|bos|>"]
    for i, m in enumerate(messages):
        role, text = _role(m), _content_text(m.get("content"), f"message {i}")
        if role == "assistant":
            calls = "".join("<|tool_call|>" + tool_call_json(c, f"message {i}") for c in m.get("tool_calls") or ())
            out.append(f"<|im_start|>assistant\n{text}{calls}<|im_end|>\n")
        elif role == "tool":
            out.append(f"<|im_start|>tool\n<|tool_result|>{m.get('tool_call_id') or ''}\n{text}<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    return "".join(out) + "<|eos|>"


# ---------------------------------------------------------------------------- reading a turn back
@dataclasses.dataclass
class AssistantTurn:
    """A generated assistant turn read back: the inverse of the template's assistant message.

    content: the text before the first <|tool_call|>. tool_calls: OpenAI-shape calls
    ({"id", "type": "function", "function": {"name", "arguments": JSON string}}) for every call that
    parsed. malformed: one message per call that did not (not JSON, not an object, no name, or cut
    off by the token budget); the agent shows these to the model as error observations and counts
    them. finished: the turn ended with its stop token <|im_end|> (False: cut off by max_tokens)."""

    content: str
    tool_calls: list[dict]
    malformed: list[str]
    finished: bool

    def message(self) -> dict:
        """The OpenAI assistant message (content None when there is no text, as OpenAI returns it)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def parse_call_json(text: str, index: int, call_id: str) -> dict:
    """The JSON after one <|tool_call|> -> an OpenAI tool call; raises ValueError saying what is wrong.
    (hermes's `<tool_call>` body is the same object: formats/tool_calls.py reads it with this.)"""
    body = text.strip()
    if not body:
        raise ValueError(f'tool call {index}: empty; expected a JSON object {{"name": ..., "arguments": {{...}}}}')
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call {index}: not valid JSON ({exc.msg} at char {exc.pos}): {body[:120]!r}") from None
    if body[end:].strip():
        raise ValueError(f"tool call {index}: text after the JSON object: {body[end:][:80]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError(f'tool call {index}: expected an object with a string "name", got {body[:120]!r}')
    args = obj.get("arguments", {})
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    elif not isinstance(args, str):
        raise ValueError(f"tool call {index} ({obj['name']}): arguments must be an object, got {args!r:.80}")
    given = obj.get("id")
    return {
        "id": given if isinstance(given, str) and given else call_id,
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


def parse_assistant(tokens: Sequence[int], tok: Tokenizer, *, call_id_prefix: str = "call") -> AssistantTurn:
    """Generated tokens of one assistant turn (after `<|im_start|>assistant\\n`, up to and
    including `<|im_end|>` when the model emitted it) -> AssistantTurn.

    Split at token level on <|tool_call|>, so text that merely mentions "<|tool_call|>" cannot
    forge a call. Calls without an "id" get f"{call_id_prefix}_{i}" (i counts this turn's calls)."""
    im_end, tool_call = tok.token_id("<|im_end|>"), tok.token_id("<|tool_call|>")
    ids = [int(t) for t in tokens]
    finished = im_end in ids
    if finished:
        ids = ids[: ids.index(im_end)]
    pieces: list[list[int]] = [[]]
    for t in ids:
        if t == tool_call:
            pieces.append([])
        else:
            pieces[-1].append(t)
    content = tok.decode(pieces[0], skip_special_tokens=True)
    calls: list[dict] = []
    malformed: list[str] = []
    for i, piece in enumerate(pieces[1:]):
        if not finished and i == len(pieces) - 2:
            malformed.append(f"tool call {i}: cut off by the token budget before <|im_end|>")
            continue
        try:
            calls.append(parse_call_json(tok.decode(piece, skip_special_tokens=True), i, f"{call_id_prefix}_{i}"))
        except ValueError as exc:
            malformed.append(str(exc))
    return AssistantTurn(content, calls, malformed, finished)

"""A checkpoint's own Jinja chat template as a `ChatFormat`: `ChatTemplate`.

The template comes from the checkpoint directory (tokenizer_config.json's `chat_template`, or a
chat_template.jinja file) and is rendered the way transformers' `apply_chat_template` renders it,
so the ids are token for token the ones the checkpoint was trained on: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
a `tojson` filter that writes json.dumps's text (ensure_ascii=False; indent, separators and
sort_keys accepted), a `{% generation %}` block tag, and the tokenizer config's special-token
strings (bos_token, eos_token, ...) as variables. The rendered text is encoded with special-token
strings read as their ids (`Tokenizer.encode_with_specials`).

Messages reach the template as vLLM hands them over (`template_messages`), whichever path renders
them (`serve`, SFT rows, the agent loop): OpenAI's JSON-text tool-call arguments become the objects
they spell, for every template, so a template writing `arguments | tojson` renders the ids vLLM
feeds the model. A template that can only concatenate the arguments as text (DeepSeek-V3's own,
on which vLLM fails) is found by a probe rendering and given text.

Loss mask: 1.0 exactly on the tokens the model emits in assistant turns, their end token included.
A template with `{% generation %}` blocks says which characters those are (the same spans
transformers' `return_assistant_tokens_mask` reads). Otherwise each assistant turn is found by
rendering the conversation before it with the generation prompt and the conversation through it:
the first must be a token prefix of the second, and the turn is what follows, through its end token.

Multi-turn policy (docs/models.md): the model's sampled tokens stay verbatim and are never
re-rendered. `prompt(m)` + a generated turn + `continuation(more)` is the next prompt; for a
template that keeps history this equals rendering the whole conversation. A template that rewrites
earlier turns (Qwen3 drops the <think> block of turns before the last user message) renders them
differently later; this format keeps them as sampled, and `conversation` (the prefix method) builds
SFT rows the same way, so training and the agent loop see the same ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from composer_jax.errors import ConfigError
from composer_jax.formats.chat_interface import ChatFormat
from composer_jax.formats.chatml import AssistantTurn
from composer_jax.formats.tokenizer import Tokenizer

# Private-use characters bracketing a generation block's output while the spans are read.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKING: ContextVar[bool] = ContextVar("chat_template_marking", default=False)
_PLACEHOLDER = "composer-jax placeholder turn"


@dataclass(frozen=True)
class Family:
    """A model family's chat facts the template alone does not state."""

    tool_syntax: str  # formats/tool_calls.py's name for the family's tool-call syntax
    end_of_turn: tuple[str, ...]
    call_start: tuple[str, ...]
    call_end: tuple[str, ...]


# family -> facts; a template is placed in a family by the marker its text holds (first match).
FAMILIES = {
    "kimi_k2": Family("kimi_k2", ("<|im_end|>",), ("<|tool_calls_section_begin|>",), ("<|tool_call_end|>",)),
    "deepseek_v3": Family(
        "deepseek_v3", ("<｜end▁of▁sentence｜>",), ("<｜tool▁calls▁begin｜>",), ("<｜tool▁call▁end｜>",)
    ),
    "qwen3_coder": Family("qwen3_coder", ("<|im_end|>",), ("<tool_call>",), ("</tool_call>",)),
    "qwen3": Family("hermes", ("<|im_end|>",), ("<tool_call>",), ("</tool_call>",)),
}
_MARKERS = (
    ("kimi_k2", "<|tool_calls_section_begin|>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>"),
    ("qwen3_coder", "<parameter="),
    ("qwen3", "<tool_call>"),
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_TEMPLATE_VARIABLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def family_of(template: str) -> str | None:
    """The family whose tool-call syntax the template writes (None: not one of FAMILIES)."""
    return next((family for family, marker in _MARKERS if marker in template), None)


def has_chat_template(directory: Path) -> bool:
    """Whether a checkpoint directory holds a Jinja chat template."""
    if (directory / "chat_template.jinja").is_file():
        return True
    cfg = directory / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Jinja's own tojson escapes HTML characters; the templates are written for json.dumps's text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """A Jinja template configured as transformers configures chat templates (module docstring)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}`: the text the model generates; its output is
        bracketed by _OPEN/_CLOSE while `_marking` is set, unchanged otherwise."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            return f"{_OPEN}{text}{_CLOSE}" if _MARKING.get() else text

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@contextmanager
def _marking() -> Iterator[None]:
    token = _MARKING.set(True)
    try:
        yield
    finally:
        _MARKING.reset(token)


def template_messages(messages: Sequence[dict], *, text_arguments: bool = False) -> list[dict]:
    """OpenAI messages as a chat template reads them, whichever path renders them (`serve`, SFT rows,
    the agent loop: all go through `ChatTemplate`), so the ids are the ones vLLM feeds the model:

    - reasoning given as `thinking` or `reasoning` is also `reasoning_content` (and `thinking`), as
      transformers hands it over;
    - tool-call arguments as vLLM passes them to every template (its chat_utils
      `_postprocess_messages`): an assistant turn's JSON text spelling an object becomes that object,
      absent, null or blank arguments become {}, and an empty `tool_calls` list is dropped. Text
      that is no JSON object stays as given (recent vLLM renders it as {}, older vLLM refuses the
      request; here it is what the model wrote, which a template's `is string` branch renders);
    - `text_arguments` (a template that can only concatenate the arguments as text, such as
      DeepSeek-V3's own: `_takes_text_arguments`): the arguments stay text, an object becomes its
      json.dumps text. vLLM refuses such a conversation (the template raises on the object).

    Returns new message dicts; `messages` is not modified."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
                if m["tool_calls"]:
                    m = {**m, "tool_calls": [_call_arguments(c, text_arguments) for c in m["tool_calls"]]}
                else:
                    m = {k: v for k, v in m.items() if k != "tool_calls"}
        out.append(m)
    return out


def _call_arguments(call: Any, text: bool) -> Any:
    """One OpenAI tool call with its arguments as `template_messages` hands them over."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call  # not a function call: the template says what it makes of it
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = "{}" if text else {}
    elif text:
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    elif isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    return {**call, "function": {**fn, "arguments": args}}


def _config_token(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


class ChatTemplate(ChatFormat):
    """A checkpoint's Jinja chat template over `tok` (module docstring). `name` names the template
    in errors (the checkpoint directory's name); `family` is a key of FAMILIES or None."""

    def __init__(self, source: str, tok: Tokenizer, *, name: str, variables: dict[str, str] | None = None):
        self.source, self.tok, self.name = source, tok, name
        self.template = compile_template(source)
        self.variables = dict(variables or {})
        self.family = family_of(source)
        self.has_generation_blocks = re.search(r"{%-?\s*generation\s*[-+]?%}", source) is not None
        self.text_arguments = self._takes_text_arguments()

    @classmethod
    def load(cls, directory: str | Path, tok: Tokenizer) -> ChatTemplate:
        """The template of a checkpoint directory: chat_template.jinja, else tokenizer_config.json's
        `chat_template` (a string, or HF's list of {"name", "template"} whose "default" is taken)."""
        d = Path(directory)
        cfg_file = d / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        source: Any = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").is_file() else None
        source = source if source is not None else cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str) or not source:
            raise ConfigError(
                f"checkpoint {str(d)!r} has no chat template: accepted are a chat_template.jinja file or "
                "tokenizer_config.json's 'chat_template' (a string, or a list holding one named 'default')"
            )
        variables = {k: v for k in _TEMPLATE_VARIABLES if (v := _config_token(cfg.get(k))) is not None}
        return cls(source, tok, name=d.name or str(d), variables=variables)

    # ---------------------------------------------------------------------------------- rendering

    def _render(self, messages: Sequence[dict], tools: Sequence[dict] | None, add_generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._render_as_given(
                template_messages(messages, text_arguments=self.text_arguments), tools, add_generation_prompt
            )
        except (TemplateError, TypeError) as e:  # TypeError: the template's own arithmetic ('x' + None)
            raise ConfigError(f"chat template {self.name!r} refused the conversation: {e}") from None

    def _render_as_given(self, messages: list[dict], tools: Sequence[dict] | None, add_generation_prompt: bool) -> str:
        return self.template.render(
            messages=messages,
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )

    def _takes_text_arguments(self) -> bool:
        """Whether the template renders tool-call arguments only as text: DeepSeek-V3's own template
        concatenates them (`'...' + tool['function']['arguments']`), which raises TypeError on the
        object vLLM hands it. Read off two probe conversations (an assistant turn without content,
        and one with): one that raises TypeError with object arguments and renders with the same
        arguments as text. A template refusing both forms, or the probe, is given objects (vLLM's rule)."""
        for content in (None, "probe"):
            as_object, as_text = self._probe(content, {"path": "a"}), self._probe(content, '{"path": "a"}')
            if isinstance(as_object, TypeError) and as_text is None:
                return True
        return False

    def _probe(self, content: str | None, arguments: Any) -> Exception | None:
        """What rendering a conversation with one tool call raises (None: it renders)."""
        call = {"id": "probe_0", "type": "function", "function": {"name": "probe", "arguments": arguments}}
        turns: list[dict] = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "probe_0", "content": "probe"},
        ]
        try:
            self._render_as_given(turns, None, False)
        except Exception as e:  # a probe: the template may refuse it for reasons of its own
            return e
        return None

    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
    ) -> str:
        """The template's text for `messages` (OpenAI-style) and OpenAI function `tools`."""
        return self._render(messages, tools, add_generation_prompt)

    def render_ids(
        self, messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
    ) -> list[int]:
        """`render`'s text as token ids, special-token strings read as their ids (transformers'
        `apply_chat_template(..., tokenize=True)`)."""
        return self.tok.encode_with_specials(self._render(messages, tools, add_generation_prompt))

    def _ids(self, tokens: Sequence[str]) -> tuple[int, ...]:
        ids = []
        for t in tokens:
            i = self.tok.hf.token_to_id(t)
            if i is None:
                raise ConfigError(
                    f"chat template {self.name!r} (family {self.family}) needs the token {t!r}, which the "
                    "tokenizer does not have"
                )
            ids.append(int(i))
        return tuple(ids)

    @property
    def end_of_turn(self) -> tuple[int, ...]:
        """The family's end-of-turn token; for a template of no known family, the config's eos."""
        if self.family is not None:
            return self._ids(FAMILIES[self.family].end_of_turn)
        eos = self.variables.get("eos_token")
        return self._ids((eos,)) if eos else (self.tok.eos_id,)

    @property
    def call_start(self) -> tuple[int, ...]:
        return self._ids(FAMILIES[self.family].call_start) if self.family else ()

    @property
    def call_end(self) -> tuple[int, ...]:
        return self._ids(FAMILIES[self.family].call_end) if self.family else ()

    @property
    def tool_syntax(self) -> str | None:
        """formats/tool_calls.py's name for the template's tool-call syntax (None: unknown family)."""
        return FAMILIES[self.family].tool_syntax if self.family else None

    def unavailable(self) -> str | None:
        """Why this template cannot serve chat: a family token the tokenizer lacks, or a template that
        refuses a one-message conversation (an export's placeholder that raises, for example)."""
        try:
            self.end_of_turn, self.call_start, self.call_end  # noqa: B018 - each raises if a token is missing
            self.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except ConfigError as e:
            return str(e)
        return None

    # ------------------------------------------------------------------------------ ChatFormat

    def prompt(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None) -> np.ndarray:
        return np.asarray(self.render_ids(messages, tools, add_generation_prompt=True), np.int32)

    def continuation(self, messages: Sequence[dict]) -> np.ndarray:
        """The tokens after a generated turn's end token when `messages` follow, through the next
        assistant header: read off a rendering where a placeholder turn stands for the generated one."""
        return np.asarray(self._after_turn(messages, add_generation_prompt=True), np.int32)

    def _after_turn(self, messages: Sequence[dict], *, add_generation_prompt: bool) -> list[int]:
        before = [{"role": "user", "content": _PLACEHOLDER}]
        header = self.render_ids(before, add_generation_prompt=True)
        turn = {"role": "assistant", "content": _PLACEHOLDER}
        ids = self.render_ids([*before, turn, *messages], add_generation_prompt=add_generation_prompt)
        if ids[: len(header)] != header:
            raise ConfigError(self._no_prefix("a placeholder user message", header, ids))
        end = next((i for i in range(len(header), len(ids)) if ids[i] in self.end_of_turn), None)
        if end is None:
            raise ConfigError(f"chat template {self.name!r}: an assistant turn does not end at {self.end_of_turn}")
        return ids[end + 1 :]

    def _no_prefix(self, what: str, head: list[int], whole: list[int]) -> str:
        at = next((i for i, (a, b) in enumerate(zip(head, whole, strict=False)) if a != b), min(len(head), len(whole)))
        return (
            f"chat template {self.name!r}: rendering {what} with the generation prompt is not a token prefix "
            f"of rendering it followed by the assistant turn (they differ at token {at} after the last "
            "end-of-turn token: "
            f"{self.tok.decode(head[at : at + 8])!r} vs {self.tok.decode(whole[at : at + 8])!r}), so its "
            "assistant turns cannot be found; mark them with {% generation %} blocks"
        )

    def _turn(self, messages: Sequence[dict], at: int, tools: Sequence[dict] | None) -> tuple[str, list[int]]:
        """(the prompt text before assistant message `at`, the turn's own tokens through its end token)."""
        head = self._render(messages[:at], tools, True)
        whole = self._render(messages[: at + 1], tools, False)
        # Added tokens split the text before BPE runs, so both texts tokenize as their common part
        # through head's last end-of-turn token followed by the rest: only the rests are encoded (a
        # long conversation would otherwise be encoded twice per turn).
        cut = max((head.rfind(e) + len(e) for e in self._end_strings() if e in head), default=0)
        cut = cut if whole[:cut] == head[:cut] else 0
        head_ids, whole_ids = self.tok.encode_with_specials(head[cut:]), self.tok.encode_with_specials(whole[cut:])
        if whole_ids[: len(head_ids)] != head_ids:
            raise ConfigError(self._no_prefix(f"messages[:{at}]", head_ids, whole_ids))
        end = next((i for i in range(len(head_ids), len(whole_ids)) if whole_ids[i] in self.end_of_turn), None)
        if end is None:
            raise ConfigError(
                f"chat template {self.name!r}: assistant message {at} does not end at an end-of-turn token "
                f"{[self.tok.decode([t]) for t in self.end_of_turn]}"
            )
        return head, whole_ids[len(head_ids) : end + 1]

    def _end_strings(self) -> list[str]:
        """The end-of-turn tokens' strings, those the tokenizer holds as added tokens that split text
        exactly where they stand (one that strips the whitespace around it would not)."""
        added = self.tok.hf.get_added_tokens_decoder()
        plain = [added[t] for t in self.end_of_turn if t in added]
        return [a.content for a in plain if not (a.lstrip or a.rstrip or a.single_word)]

    def conversation(
        self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, where: str = "conversation"
    ) -> tuple[np.ndarray, np.ndarray]:
        try:
            method = self._by_blocks if self.has_generation_blocks else self._by_turns
            ids, mask = method(messages, tools)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        return np.asarray(ids, np.int32), np.asarray(mask, np.float32)

    def _by_turns(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> tuple[list[int], list[float]]:
        """The prefix method, turn by turn as the agent loop builds it (the multi-turn policy)."""
        starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not starts:
            plain = self.render_ids(messages, tools)
            return plain, [0.0] * len(plain)
        ids: list[int] = []
        mask: list[float] = []
        for k, at in enumerate(starts):
            head, turn = self._turn(messages, at, tools)
            if k == 0:
                before = self.tok.encode_with_specials(head)
            else:
                before = self._after_turn(messages[starts[k - 1] + 1 : at], add_generation_prompt=True)
            ids += before + turn
            mask += [0.0] * len(before) + [1.0] * len(turn)
        tail = self._after_turn(messages[starts[-1] + 1 :], add_generation_prompt=False)
        return ids + tail, mask + [0.0] * len(tail)

    def _by_blocks(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> tuple[list[int], list[float]]:
        """The whole rendering, masked where the template's {% generation %} blocks wrote (a token is
        masked when its characters overlap a block's, as transformers' assistant mask reads them)."""
        if any(_OPEN in json.dumps(m) or _CLOSE in json.dumps(m) for m in messages):
            raise ConfigError("messages hold U+E000/U+E001, which mark generation blocks here; remove them")
        with _marking():
            marked = self._render(messages, tools, False)
        spans, text, at = [], [], 0
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
            if piece == _OPEN:
                spans.append([at, at])
            elif piece == _CLOSE:
                spans[-1][1] = at
            else:
                text.append(piece)
                at += len(piece)
        ids, offsets = self.tok.offsets_with_specials("".join(text))
        mask = [1.0 if any(s < b and e > a for a, b in spans) else 0.0 for s, e in offsets]
        for a, b in spans:
            last = max((i for i, (s, _) in enumerate(offsets) if s < b), default=None)
            if a < b and (last is None or ids[last] not in self.end_of_turn):
                raise ConfigError(
                    f"chat template {self.name!r}: a {{% generation %}} block does not end with the end-of-turn "
                    f"token {[self.tok.decode([t]) for t in self.end_of_turn]}, so the stop token would not be trained"
                )
        return ids, mask

    def parse(self, tokens: Sequence[int], *, call_id_prefix: str = "call") -> AssistantTurn:
        """The turn's text read by formats/tool_calls.py's parser for the family's syntax; a turn
        that did not reach its end-of-turn token is unfinished (cut off by the token budget)."""
        from composer_jax.formats.tool_calls import parse_turn

        if self.tool_syntax is None:
            raise ConfigError(
                f"chat template {self.name!r} writes no known tool-call syntax; known: "
                f"{sorted({f.tool_syntax for f in FAMILIES.values()})}"
            )
        ids = [int(t) for t in tokens]
        finished = bool(ids) and ids[-1] in self.end_of_turn
        text = self.tok.decode(ids[:-1] if finished else ids)
        turn = parse_turn(self.tool_syntax, text, call_id_prefix=call_id_prefix, finished=finished)
        turn.content = turn.content.strip()  # the template's separators around the calls are not content
        return turn

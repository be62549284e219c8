"""A checkpoint's conversation interface, as every user of chat sees it: `ChatFormat`.

SFT rows (`conversation`: tokens and the loss mask), the agent loop's prompts (`prompt`, then
`continuation` after each generated turn, so the model's own tokens stay verbatim), reading a
generated turn back into content and tool calls (`parse`), the token(s) an assistant turn ends at
(`end_of_turn`, the samplers' stop tokens) and, where the tokenizer cannot speak the format, why
(`unavailable`). Users hold a `ChatFormat` and never ask which one it is.

`ChatML` is the project's own format, composer-chatml-v1 (formats/chatml.py), the tiny models'.
A checkpoint's own Jinja template with its tool-call syntax is another implementation of the same
interface; `chat_format(tok)` picks the format a tokenizer speaks.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from composer_jax.errors import ConfigError
from composer_jax.formats import chatml
from composer_jax.formats.chatml import AssistantTurn
from composer_jax.formats.tokenizer import CHAT_TEMPLATE_NAME, Tokenizer


class ChatFormat(ABC):
    """How conversations become tokens for one tokenizer, and generated tokens become turns.

    Messages are OpenAI-style (formats/chatml.py's docstring); `tools` are OpenAI function tools."""

    name: str
    tok: Tokenizer

    @abstractmethod
    def conversation(
        self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, where: str = "conversation"
    ) -> tuple[np.ndarray, np.ndarray]:
        """A whole conversation -> (tokens int32[n], loss_mask float32[n]): 1.0 exactly on the tokens
        the model emits in assistant turns, their end token included. `where` prefixes errors."""

    @abstractmethod
    def prompt(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None) -> np.ndarray:
        """The conversation so far and the next assistant turn's header: int32[n], the prompt to
        sample that turn from."""

    @abstractmethod
    def continuation(self, messages: Sequence[dict]) -> np.ndarray:
        """What follows a generated assistant turn (which ended at its end token) when `messages`
        (tool results, a user message) come next, up to the next assistant header: int32[n]. So
        prompt(m) + the turn's own tokens + continuation(more) is the next prompt, the generated
        tokens kept verbatim."""

    @abstractmethod
    def parse(self, tokens: Sequence[int], *, call_id_prefix: str = "call") -> AssistantTurn:
        """One generated assistant turn (its end token included when the model emitted it) read back:
        content, tool calls, and the calls that did not parse (broken calls, shown to the model)."""

    @property
    @abstractmethod
    def end_of_turn(self) -> tuple[int, ...]:
        """The token ids an assistant turn ends at (a sampler's stop tokens)."""

    @property
    def native_tools(self) -> bool:
        """Whether the agent loop gives the model its session's tool schemas through this format's
        `tools` (a checkpoint's own template renders them as the model was trained to read them)."""
        return True

    @property
    def call_start(self) -> tuple[int, ...]:
        """The token ids a tool call (or a format's tool-call section) begins at; () when the format
        has no tool calls. A turn's content is what precedes the first of them."""
        return ()

    @property
    def call_end(self) -> tuple[int, ...]:
        """The token ids that close one tool call (a streamer reads the turn again after each);
        () where a call is closed only by the next call or the end of the turn."""
        return ()

    def call_opening(self, function: str | None = None) -> list[int]:
        """The tokens that open the assistant turn when a tool call is forced (OpenAI's tool_choice
        "required", or a named function): the call's start token, and, where the format can spell
        it, the function's name. Raises ConfigError where the format has no tool calls."""
        if not self.call_start:
            raise ConfigError(f"chat format {self.name!r} has no tool-call syntax: a tool call cannot be forced")
        return [self.call_start[0]]

    def content_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The content part of a (partial) assistant turn: its tokens before the first call start
        or end of turn."""
        ends = {*self.call_start, *self.end_of_turn}
        out: list[int] = []
        for t in tokens:
            if t in ends:
                break
            out.append(int(t))
        return out

    def closed_calls(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of a turn still being generated whose tool calls are all complete,
        read as a finished turn (so `parse` of it returns exactly the calls a client can be sent
        now); [] when no call is complete yet."""
        closers = {*self.call_start, *self.call_end, *self.end_of_turn}
        last = max((i for i, t in enumerate(tokens) if t in closers and i > 0), default=-1)
        if last < 0:
            return []
        cut = list(tokens[: last + 1]) if tokens[last] in self.call_end else list(tokens[:last])
        return [*cut, self.end_of_turn[0]]

    def unavailable(self) -> str | None:
        """Why this tokenizer cannot speak the format (None when it can); servers say it once."""
        return None


class ChatML(ChatFormat):
    """composer-chatml-v1 (formats/chatml.py) over `tok`."""

    name = CHAT_TEMPLATE_NAME

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def conversation(
        self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, where: str = "conversation"
    ) -> tuple[np.ndarray, np.ndarray]:
        return chatml.render_chat(messages, self.tok, where=where, tools=tools)

    def prompt(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None) -> np.ndarray:
        return chatml.render_prompt(messages, self.tok, tools=tools)

    def continuation(self, messages: Sequence[dict]) -> np.ndarray:
        return chatml.render_continuation(messages, self.tok)

    def parse(self, tokens: Sequence[int], *, call_id_prefix: str = "call") -> AssistantTurn:
        return chatml.parse_assistant(tokens, self.tok, call_id_prefix=call_id_prefix)

    @property
    def end_of_turn(self) -> tuple[int, ...]:
        return (self.tok.token_id("<|im_end|>"),)

    def unavailable(self) -> str | None:
        return chatml.chat_unavailable(self.tok)

    @property
    def native_tools(self) -> bool:
        """False: the tiny models learn their tools from the environment's system prompt, which
        names each with its arguments (the SFT conversations, `data make-sft`); composer-chatml-v1's
        tools block is rendered for `serve` requests that send `tools`, never by the agent loop."""
        return False

    @property
    def call_start(self) -> tuple[int, ...]:
        return (self.tok.token_id("<|tool_call|>"),)

    def call_opening(self, function: str | None = None) -> list[int]:
        """`<|tool_call|>`, and for a named function N `{"name": "N", "arguments":`: the format's
        own spelling cut where a BPE word ends, so the model's continuation tokenizes as in
        training. The model then writes the arguments: the sampler has no grammar engine."""
        opening = [self.tok.token_id("<|tool_call|>")]
        if function is not None:
            opening += self.tok.encode(json.dumps({"name": function}, ensure_ascii=False)[:-1] + ', "arguments":')
        return opening


def chat_format(tok: Tokenizer) -> ChatFormat:
    """The chat format `tok` speaks (made once per tokenizer object)."""
    made = getattr(tok, "_chat_format", None)
    if made is None:
        made = ChatML(tok)
        object.__setattr__(tok, "_chat_format", made)  # a frozen dataclass; the format is derived state
    return made

"""The `ChatFormat` interface (formats/chat_format.py describes it and picks one for a tokenizer).

It lives apart from the implementations so that each of them (chat_format.ChatML,
chat_template.ChatTemplate) imports it and chat_format.py can import them all without a circle."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from composer_jax.errors import ConfigError
from composer_jax.formats.chatml import AssistantTurn
from composer_jax.formats.tokenizer import Tokenizer


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

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

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

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


def chat_format(tok: Tokenizer) -> ChatFormat:
    """The chat format `tok` speaks."""
    return ChatML(tok)

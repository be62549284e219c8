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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from composer_jax.formats import chatml
from composer_jax.formats.chat_interface import ChatFormat
from composer_jax.formats.chat_template import ChatTemplate, has_chat_template
from composer_jax.formats.chatml import AssistantTurn
from composer_jax.formats.tokenizer import CHAT_TEMPLATE_NAME, Tokenizer

__all__ = ["ChatFormat", "ChatML", "ChatTemplate", "chat_format"]


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
    """The chat format `tok` speaks (made once per tokenizer object): composer-chatml-v1 when the
    tokenizer has its tokens, else the checkpoint's own Jinja template when the tokenizer's
    directory holds one (tokenizer_config.json's `chat_template`, or chat_template.jinja), else
    composer-chatml-v1, whose `unavailable` then says what is missing."""
    made = getattr(tok, "_chat_format", None)
    if made is None:
        if chatml.missing_chat_tokens(tok) and tok.source is not None and has_chat_template(Path(tok.source)):
            made = ChatTemplate.load(Path(tok.source), tok)
        else:
            made = ChatML(tok)
        object.__setattr__(tok, "_chat_format", made)  # a frozen dataclass; the format is derived state
    return made

"""Scripted policies for the RL tests: the agent loop and evaluation are under test, not a model.
Each turn is text in the chat template, tokenised and read back by the real `parse_assistant`,
exactly as a sampled turn is."""

from __future__ import annotations

import json

from composer_jax.formats.chatml import parse_assistant
from composer_jax.rl.samplers.policy import Generation, TurnRequest


def call(name: str, **args) -> str:
    return "<|tool_call|>" + json.dumps({"name": name, "arguments": args})


class ScriptedPolicy:
    """Plays fixed turns; contexts grow by a fixed token count per message (for the budget)."""

    def __init__(self, turns: list[str], tok, max_context: int = 100_000, tokens_per_message: int = 10):
        self.turns, self.tok, self.max_context, self.per = list(turns), tok, max_context, tokens_per_message
        self.requests: list[TurnRequest] = []
        self.contexts: list[int] = []  # context length when each turn was asked for
        self.hook = None

    def begin(self, messages, tools=None):
        return Generation(list(messages), tokens=[0] * self.per * len(messages))

    def extend(self, gen, messages):
        gen.messages.extend(messages)
        gen.tokens += [0] * self.per * len(messages)

    def next_text(self, gen, req) -> str:
        return self.turns.pop(0)

    async def turn(self, gen, req):
        self.requests.append(req)
        if self.hook is not None:
            await self.hook(len(self.requests))
        text = self.next_text(gen, req)
        self.contexts.append(gen.context_len())
        pieces = text.split("<|tool_call|>")
        ids = self.tok.encode(pieces[0])
        for p in pieces[1:]:
            ids += [self.tok.token_id("<|tool_call|>")] + self.tok.encode(p)
        ids += [self.tok.token_id("<|im_end|>")]
        gen.tokens += ids
        gen.generated += len(ids)
        turn = parse_assistant(ids, self.tok, call_id_prefix=f"c{len(gen.messages)}")
        gen.messages.append(turn.message())
        return turn

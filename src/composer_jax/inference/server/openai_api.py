"""The OpenAI API's request and response shapes: checking a request body, building the response.

Pure functions over dicts (no HTTP, no engine), so the server's reading of a request and its
response for given generated tokens are tested without a server.

Requests: `/v1/completions` (prompt: a string, token ids, or a list of either) and
`/v1/chat/completions` (messages in the tokenizer's chat format, `formats/chat_format.py`, with `tools`).
Supported fields: model, max_tokens (chat: also max_completion_tokens), temperature, top_p, n,
seed, stop, stream, stream_options.include_usage, logprobs (completions: 0, the sampled tokens'
log-probabilities; chat: true with top_logprobs 0), tools, tool_choice ("none", "auto",
"required" or a named function: `tool_choice` below) and parallel_tool_calls (chat);
extensions: top_k, return_routing, return_prompt_routing, and vLLM's stop_token_ids (extra stop
tokens), ignore_eos (do not stop at the default stop tokens), return_token_ids (the prompt's ids
back, where vLLM puts them: `response_fields`) and, for completions, prompt_logprobs: 0 (each prompt
token's log-probability given the ones before it, on every choice in vLLM's shape:
`server/prompt_logprobs.py`; not with stream, as vLLM). Fields OpenAI defines that the sampler cannot honour
(echo, best_of, suffix, logit_bias, penalties, top alternatives in logprobs) are refused with a
400 naming them; unknown fields are ignored (clients send e.g. `user`).

Every choice carries two extension fields: `token_ids` (the generated tokens) and
`token_versions` (the policy version that produced each), and with `return_routing` also
`routed_experts`, with `return_prompt_routing` `prompt_routed_experts` (module `build_choice` docstring).
With `return_token_ids` a completion choice also carries `prompt_token_ids`, and a chat response
does at its top level (vLLM's fields: what a user checks a chat template's rendering with).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from composer_jax.errors import ConfigError
from composer_jax.formats.byte_level import CHAR_TO_BYTE as _BYTE_OF
from composer_jax.formats.chat_format import ChatFormat, chat_format
from composer_jax.formats.chatml import AssistantTurn, check_tools
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.inference.engine.token_sampling import SamplingParams

MAX_N = 16
MAX_STOP = 16
MAX_SEED = 2**32 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {
            401: "invalid_request_error",  # what OpenAI answers for a wrong key (code invalid_api_key)
            403: "permission_error",
            404: "not_found_error",
            409: "conflict_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


# ---------------------------------------------------------------------------- field readers
def int_field(body: dict, key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    """body[key] as an integer in [lo, hi] (default when absent or null); ApiError naming it otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(key, f"{v!r} is not an integer")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        accepted = f">= {lo}" if hi is None else f"{lo}..{hi}"
        raise _bad(key, f"{v} is out of range; accepted: {accepted}")
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(key, f"{v!r} is not a number")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(key, f"{v} is out of range; accepted: {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"{v!r} is not a boolean (true or false)")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOP:
        raise _bad("stop", f"{v!r:.200} is not accepted; accepted: a non-empty string or a list of at most {MAX_STOP}")
    return tuple(items)


def _refuse_unsupported(body: dict) -> None:
    if body.get("echo"):
        raise _bad(
            "echo", "echo=true is not supported (the prompt's log-probabilities are not computed)", "unsupported"
        )
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", f"{body['best_of']!r} is not supported; accepted: 1 (use n for several choices)")
    if body.get("suffix"):
        raise _bad("suffix", "insertion (suffix) is not supported", "unsupported")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "logit_bias is not supported", "unsupported")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(key, f"{body[key]!r} is not supported; accepted: 0", "unsupported")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise _bad("response_format", "only {'type': 'text'} is supported", "unsupported")


# ---------------------------------------------------------------------------- requests
@dataclasses.dataclass
class Generation:
    """One HTTP request's work. prompts: token ids per prompt (chat: one); choice c of the
    response is prompt c // n with params[c]. stop: the stop strings (cut from the text)."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]
    n: int
    params: list[SamplingParams]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    return_routing: bool
    tools: list[dict] | None = None
    return_prompt_routing: bool = False
    return_token_ids: bool = False  # the prompt's ids in the response (`response_fields`, `build_choice`)
    forced: list[int] = dataclasses.field(default_factory=list)  # chat: the turn's opening, prefilled
    tool_choice: str = "auto"  # chat: "none" | "auto" | "required" | "function" (the one named)
    parallel_tool_calls: bool = True  # chat: False keeps only a turn's first tool call
    prompt_logprobs: bool = False  # completions: vLLM's prompt_logprobs (0) on every choice


def _model(body: dict, served: str) -> str:
    model = body.get("model", served)
    if model != served:
        raise ApiError(
            404, f"model {model!r} is not served here; accepted: [{served!r}]", param="model", code="model_not_found"
        )
    return served


def _common(
    body: dict,
    *,
    prompt_lens: list[int],
    max_len: int,
    default_max_tokens: int | None,
    stop_ids: tuple[int, ...],
    vocab: int,
) -> tuple[int, list[SamplingParams], tuple[str, ...], dict[str, bool]]:
    n = int_field(body, "n", 1, 1, MAX_N)
    assert n is not None
    longest = max(prompt_lens)
    if longest >= max_len:
        raise ApiError(
            400,
            f"the prompt is {longest} tokens, but this server's context is {max_len} tokens (prompt + "
            f"max_tokens); shorten the prompt to at most {max_len - 1} tokens",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = int_field(body, key, default_max_tokens, 1)
    if max_tokens is None:  # chat's default: the rest of the context
        max_tokens = max_len - longest
    if longest + max_tokens > max_len:
        raise ApiError(
            400,
            f"{key}={max_tokens} plus the prompt's {longest} tokens = {longest + max_tokens} exceeds this "
            f"server's context of {max_len} tokens; accepted: {key} <= {max_len - longest}",
            param=key,
            code="context_length_exceeded",
        )
    temperature = _float(body, "temperature", 1.0, 0.0, 1e6)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = int_field(body, "top_k", 0, 0)
    seed = int_field(body, "seed", None, 0, MAX_SEED)
    if seed is None:
        seed = secrets.randbelow(MAX_SEED)  # OpenAI: no seed, no determinism
    stop = _stop(body)
    extra = body.get("stop_token_ids")
    if extra is not None and (
        not isinstance(extra, list)
        or len(extra) > 64
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in extra)
    ):
        raise _bad(
            "stop_token_ids",
            f"{extra!r:.100} is not accepted; accepted: a list of at most 64 token ids in [0, {vocab})",
        )
    stop_ids = (() if _bool(body, "ignore_eos") else stop_ids) + tuple(t for t in extra or () if t not in stop_ids)
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or 0,
            max_tokens=max_tokens,
            seed=(seed + i) % (MAX_SEED + 1),  # choice i of a prompt: seed + i
            stop_token_ids=stop_ids,
            stop_strings=stop,
        )
        for _ in prompt_lens
        for i in range(n)
    ]
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise _bad("stream_options", f"{opts!r:.100} is accepted only as an object with stream=true")
    flags = {
        "stream": stream,
        "include_usage": bool(opts and _bool(opts, "include_usage")),
        "return_routing": _bool(body, "return_routing"),
        "return_prompt_routing": _bool(body, "return_prompt_routing"),
        "return_token_ids": _bool(body, "return_token_ids"),
    }
    return n, params, stop, flags


def _flags(flags: dict[str, bool]) -> tuple[bool, bool, bool]:
    return flags["stream"], flags["include_usage"], flags["return_routing"]


def _prompt_ids(prompt: Any, tok: Tokenizer, vocab: int, where: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad(where, "the prompt is empty")
        return [tok.bos_id, *tok.encode(prompt)]  # documents start with <|bos|> in training
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise _bad(where, f"token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        return list(prompt)
    raise _bad(where, f"{prompt!r:.100} is not accepted; accepted: a non-empty string or a non-empty list of token ids")


def parse_completion(body: Any, *, tok: Tokenizer, served: str, max_len: int, vocab: int) -> Generation:
    """A /v1/completions body -> Generation; raises ApiError naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = _model(body, served)
    _refuse_unsupported(body)
    if "prompt" not in body:
        raise _bad("prompt", "is required: a string, a list of token ids, or a list of either", "missing")
    raw = body["prompt"]
    batch = isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw)
    items = raw if batch else [raw]
    prompts = [_prompt_ids(p, tok, vocab, f"prompt[{i}]" if batch else "prompt") for i, p in enumerate(items)]
    logprobs = int_field(body, "logprobs", None, 0, 5)
    if logprobs:
        raise _bad(
            "logprobs",
            f"{logprobs} alternatives per token are not computed by this sampler; accepted: 0 "
            "(the sampled tokens' log-probabilities) or null",
            "unsupported",
        )
    prompt_logprobs = int_field(body, "prompt_logprobs", None, -1, 20)
    if prompt_logprobs:
        raise _bad(
            "prompt_logprobs",
            f"{prompt_logprobs} alternatives per prompt token are not computed by this server; accepted: 0 "
            "(the prompt tokens' own log-probabilities) or null",
            "unsupported",
        )
    if prompt_logprobs is not None and body.get("stream"):
        raise _bad("prompt_logprobs", "prompt_logprobs are not available with stream=true", "unsupported")
    n, params, stop, flags = _common(
        body,
        prompt_lens=[len(p) for p in prompts],
        max_len=max_len,
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        stop_ids=(tok.eos_id,),
        vocab=vocab,
    )
    stream, include_usage, routing = _flags(flags)
    return Generation(
        "completion",
        model,
        prompts,
        n,
        params,
        stop,
        stream,
        include_usage,
        logprobs is not None,
        routing,
        return_prompt_routing=flags["return_prompt_routing"],
        return_token_ids=flags["return_token_ids"],
        prompt_logprobs=prompt_logprobs is not None,
    )


def parse_chat(body: Any, *, tok: Tokenizer, served: str, max_len: int, vocab: int) -> Generation:
    """A /v1/chat/completions body -> Generation; raises ApiError naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = _model(body, served)
    chat = chat_format(tok)
    if (why := chat.unavailable()) is not None:
        raise ApiError(400, why, code="chat_unavailable")
    _refuse_unsupported(body)
    tools = None
    if body.get("tools") is not None:
        try:
            tools = check_tools(body["tools"], "tools")
        except ConfigError as e:
            raise ApiError(400, str(e), param="tools", code="invalid_tools") from None
        tools = body["tools"]
    choice, function = tool_choice(body.get("tool_choice"), tools)
    if "messages" not in body:
        raise _bad("messages", "is required: a non-empty list of messages", "missing")
    try:
        prompt = chat.prompt(body["messages"], tools=tools if choice != "none" else None)
    except ConfigError as e:
        raise ApiError(400, f"messages: {e}", param="messages", code="invalid_messages") from None
    except (AttributeError, TypeError) as e:  # e.g. a message's tool_calls that is not a list
        raise ApiError(400, f"messages: malformed ({e})", param="messages", code="invalid_messages") from None
    forced = forced_opening(chat, choice, function)
    top = int_field(body, "top_logprobs", None, 0, 20)
    if top:
        raise _bad(
            "top_logprobs",
            f"{top} alternatives per token are not computed by this sampler; accepted: 0 or null",
            "unsupported",
        )
    logprobs = _bool(body, "logprobs")
    stop_ids = tuple(dict.fromkeys(t for t in (*chat.end_of_turn, tok.eos_id) if t is not None))
    if choice == "none":  # the turn ends where a tool call would begin
        stop_ids += chat.call_start
    prompt_ids = [*prompt.tolist(), *forced]
    n, params, stop, flags = _common(
        body, prompt_lens=[len(prompt_ids)], max_len=max_len, default_max_tokens=None, stop_ids=stop_ids, vocab=vocab
    )
    stream, include_usage, routing = _flags(flags)
    return Generation(
        "chat",
        model,
        [prompt_ids],
        n,
        params,
        stop,
        stream,
        include_usage,
        logprobs,
        routing,
        tools,
        return_prompt_routing=flags["return_prompt_routing"],
        return_token_ids=flags["return_token_ids"],
        forced=forced,
        tool_choice=choice,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
    )


def tool_choice(value: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    """The request's tool_choice -> (mode: "none" | "auto" | "required" | "function", the name of
    the function to call for "function", else None).

    Default: "auto" (OpenAI's default with tools; without tools nothing can be called anyway).
    "required" and a named function need tools; a name must be one of them."""
    names = [t["function"]["name"] for t in tools or ()]
    if value is None or value in ("none", "auto"):
        return value or "auto", None
    name = _named_function(value)
    if value == "required" or name is not None:
        if not names:
            raise _bad("tool_choice", f"{value!r:.100} needs tools; the request gives none", "invalid_value")
        if name is not None and name not in names:
            raise _bad("tool_choice", f"function {name!r} is not among the tools given: {names}", "invalid_value")
        return ("required", None) if name is None else ("function", name)
    raise _bad(
        "tool_choice",
        f"{value!r:.100} is not accepted; accepted: 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": NAME}}',
    )


def _named_function(value: Any) -> str | None:
    """{"type": "function", "function": {"name": N}} -> N; None for anything else."""
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def forced_opening(chat: ChatFormat, choice: str, function: str | None = None) -> list[int]:
    """The tokens that open the assistant turn when a call is forced (appended to the prompt):
    the format's `call_opening` (for composer-chatml-v1, "required": `<|tool_call|>`; a named
    function N: `<|tool_call|>{"name": "N", "arguments":`); nothing for "none" and "auto". The
    model then writes the rest of the call: the sampler has no grammar engine to force more."""
    if choice in ("none", "auto"):
        return []
    try:
        return chat.call_opening(function if choice == "function" else None)
    except ConfigError as e:
        raise _bad("tool_choice", str(e), "unsupported") from None


# ---------------------------------------------------------------------------- text and tokens


def token_bytes(tok: Tokenizer, token: int) -> bytes:
    """The bytes a token stands for (a special token: its name in UTF-8)."""
    piece = tok.hf.id_to_token(int(token))
    if piece is None:
        return b""
    if piece in tok.special:
        return piece.encode("utf-8")
    if all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    return tok.decode([token]).encode("utf-8")  # not a byte-level vocabulary


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """text up to the earliest stop string (OpenAI leaves it out), and whether one occurred."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def streamable(text: str, stop: Sequence[str]) -> str:
    """The part of a growing text that can be sent now: not a trailing incomplete UTF-8 character
    (decoded as U+FFFD) and not a suffix that may still become a stop string."""
    text, hit = cut_at_stop(text, stop)
    if hit:
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]


def completion_text(tok: Tokenizer, tokens: Sequence[int], stop: Sequence[str]) -> str:
    return cut_at_stop(tok.decode(tokens, skip_special_tokens=True), stop)[0]


def chat_content_tokens(tok: Tokenizer, tokens: Sequence[int]) -> list[int]:
    """The content part of an assistant turn (ChatFormat.content_tokens)."""
    return chat_format(tok).content_tokens(tokens)


# ---------------------------------------------------------------------------- responses
def completion_logprobs(tok: Tokenizer, tokens: Sequence[int], logprobs: Sequence[float], offset: int = 0) -> dict:
    """The /v1/completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset);
    text_offset counts characters from `offset` (the text already sent)."""
    pieces = [tok.decode([t]) for t in tokens]
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": pieces,
        "token_logprobs": [float(x) for x in logprobs],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_logprobs(tok: Tokenizer, tokens: Sequence[int], logprobs: Sequence[float]) -> dict:
    """The chat `logprobs` object: {"content": [{"token", "logprob", "bytes", "top_logprobs": []}],
    "refusal": None}, one entry per generated token (tool-call and stop tokens included: the
    trainer needs every sampled token's log-probability)."""
    content = []
    for t, lp in zip(tokens, logprobs):
        b = token_bytes(tok, t)
        content.append(
            {
                "token": b.decode("utf-8", "replace"),
                "logprob": float(lp),
                "bytes": list(b),
                "top_logprobs": [],
            }
        )
    return {"content": content, "refusal": None}


def routing_field(routing: np.ndarray | None, prompt_len: int) -> list | None:
    """int32[prompt + generated - 1, moe_layers, k] (Completion.routing) -> the experts of each
    generated token fed back through the model: [generated - 1][moe_layers][k]. None for dense
    models."""
    if routing is None:
        return None
    return np.asarray(routing[prompt_len:], np.int64).tolist()


def prompt_routing_field(routing: np.ndarray | None, prompt_len: int) -> list | None:
    """Completion.routing -> the experts of each prompt position: [prompt][moe_layers][k]."""
    if routing is None:
        return None
    return np.asarray(routing[:prompt_len], np.int64).tolist()


def turn_of(tok: Tokenizer, tokens: Sequence[int], call_id_prefix: str) -> AssistantTurn:
    return chat_format(tok).parse(tokens, call_id_prefix=call_id_prefix)


def chat_turn(gen: Generation, tok: Tokenizer, tokens: Sequence[int], call_id_prefix: str) -> AssistantTurn:
    """The assistant turn of a chat request's generated tokens: read after its forced opening,
    with no tool calls under tool_choice "none" (the turn stopped where one would begin) and only
    the first under parallel_tool_calls false."""
    turn = turn_of(tok, [*gen.forced, *tokens], call_id_prefix)
    if gen.tool_choice == "none":
        turn.tool_calls, turn.malformed = [], []
    elif not gen.parallel_tool_calls:
        turn.tool_calls = turn.tool_calls[:1]
    return turn


def finished_calls(gen: Generation, tok: Tokenizer, tokens: Sequence[int], call_id_prefix: str) -> list[dict]:
    """The tool calls of a turn still being generated that are complete (ChatFormat.closed_calls:
    for composer-chatml-v1, those closed by a later `<|tool_call|>` or by `<|im_end|>`; only a
    whole call can be checked)."""
    closed = chat_format(tok).closed_calls([*gen.forced, *tokens])
    if not closed:
        return []
    return chat_turn(dataclasses.replace(gen, forced=[]), tok, closed, call_id_prefix).tool_calls


ARGUMENT_FRAGMENT = 16  # characters of arguments per streamed tool-call delta


def tool_call_deltas(index: int, call: dict) -> list[dict]:
    """One tool call -> its streamed deltas: the first carries index, id, type, function.name and
    the first arguments fragment, the others index and the next fragments (OpenAI's shape)."""
    args = call["function"]["arguments"]
    frags = [args[i : i + ARGUMENT_FRAGMENT] for i in range(0, len(args), ARGUMENT_FRAGMENT)] or [""]
    first = {
        "index": index,
        "id": call["id"],
        "type": "function",
        "function": {"name": call["function"]["name"], "arguments": frags[0]},
    }
    return [first] + [{"index": index, "function": {"arguments": f}} for f in frags[1:]]


def completion_choice(gen: Generation, index: int, tok: Tokenizer, done: Any, call_id_prefix: str) -> dict:
    """`build_choice` for a finished `inference.engine.slot_table.Completion`."""
    return build_choice(
        gen,
        index,
        tok,
        tokens=done.tokens,
        logprobs=done.logprobs,
        versions=done.versions,
        finish_reason=done.finish_reason,
        routing=done.routing,
        prompt_len=len(done.prompt),
        call_id_prefix=call_id_prefix,
    )


def build_choice(
    gen: Generation,
    index: int,
    tok: Tokenizer,
    *,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    finish_reason: str,
    routing: np.ndarray | None,
    prompt_len: int,
    call_id_prefix: str,
) -> dict:
    """One choice of a non-streamed response.

    Extension fields: `token_ids` (the generated tokens, stop token included), `token_versions`
    (per generated token, the policy version of the weights that produced it), `routed_experts`
    (with return_routing: per generated token but the last, which no forward pass has seen, per
    MoE layer, the k expert ids it was routed to; null for dense models), `prompt_routed_experts`
    (with return_prompt_routing: the same for every prompt position, from this request's prefill, so
    that prompt + routed_experts rows cover every position but the last), `prompt_token_ids`
    (completions, with return_token_ids: the prompt's ids; chat has them once, `response_fields`),
    and for chat `malformed_tool_calls` (why each unparseable tool call was dropped)."""
    choice: dict[str, Any] = {"index": index}
    if gen.kind == "completion":
        choice["text"] = completion_text(tok, tokens, gen.stop)
        choice["logprobs"] = completion_logprobs(tok, tokens, logprobs) if gen.logprobs else None
        choice["finish_reason"] = finish_reason
    else:
        turn = chat_turn(gen, tok, tokens, call_id_prefix)
        message = turn.message()
        if message["content"] is not None:
            message["content"] = cut_at_stop(message["content"], gen.stop)[0] or None
        choice["message"] = message
        choice["logprobs"] = chat_logprobs(tok, tokens, logprobs) if gen.logprobs else None
        choice["finish_reason"] = "tool_calls" if turn.tool_calls and finish_reason == "stop" else finish_reason
        choice["malformed_tool_calls"] = turn.malformed
    choice["token_ids"] = [int(t) for t in tokens]
    choice["token_versions"] = [int(v) for v in versions]
    if gen.return_routing:
        choice["routed_experts"] = routing_field(routing, prompt_len)
    if gen.return_prompt_routing:
        choice["prompt_routed_experts"] = prompt_routing_field(routing, prompt_len)
    choice.update(prompt_ids_field(gen, index))
    return choice


def prompt_ids_field(gen: Generation, index: int) -> dict:
    """Completions with return_token_ids: {"prompt_token_ids": choice index's prompt ids} (vLLM
    puts them on each choice, streamed in a choice's first chunk); else {}."""
    if gen.kind != "completion" or not gen.return_token_ids:
        return {}
    return {"prompt_token_ids": [int(t) for t in gen.prompts[index // gen.n]]}


def response_fields(gen: Generation) -> dict:
    """Chat with return_token_ids: {"prompt_token_ids": the rendered prompt's ids, a forced call
    opening included} at the response's top level (vLLM's place; streamed in the first chunk);
    else {}. With `token_ids` they are every token the model saw or wrote."""
    if gen.kind != "chat" or not gen.return_token_ids:
        return {}
    return {"prompt_token_ids": [int(t) for t in gen.prompts[0]]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }

"""The vLLM-style extension fields of /v1/completions that the remote token policy sends:
stop_token_ids, ignore_eos, return_prompt_routing (inference/server/openai_api.py, pure functions)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.server import openai_api as api

TOK = load_tokenizer(Path(__file__).resolve().parents[3] / "assets" / "tokenizer")


def _parse(**body):
    return api.parse_completion({"prompt": [1, 2, 3], **body}, tok=TOK, served="m", max_len=64, vocab=TOK.vocab_size)


def test_stop_token_ids_and_ignore_eos():
    im_end = TOK.token_id("<|im_end|>")
    assert _parse().params[0].stop_token_ids == (TOK.eos_id,)
    assert _parse(stop_token_ids=[im_end]).params[0].stop_token_ids == (TOK.eos_id, im_end)
    assert _parse(stop_token_ids=[im_end], ignore_eos=True).params[0].stop_token_ids == (im_end,)
    assert _parse(ignore_eos=True).params[0].stop_token_ids == ()
    for bad in ([TOK.vocab_size], [-1], "5", [True], list(range(65))):
        with pytest.raises(
            api.ApiError, match=rf"stop_token_ids.*accepted: a list of at most 64 token ids in \[0, {TOK.vocab_size}\)"
        ):
            _parse(stop_token_ids=bad)
    with pytest.raises(api.ApiError, match="ignore_eos"):
        _parse(ignore_eos="yes")


def test_prompt_routing_field_and_choice():
    gen = _parse(return_routing=True, return_prompt_routing=True)
    assert gen.return_prompt_routing and gen.return_routing
    routing = np.arange(6 * 2 * 3).reshape(6, 2, 3)  # prompt 3 + generated 4 - 1 positions
    done = type("Done", (), {})()
    done.tokens, done.logprobs, done.versions = [7, 8, 9, 10], [-1.0, -2.0, -3.0, -4.0], [0, 0, 1, 1]
    done.finish_reason, done.routing, done.prompt = "length", routing, [1, 2, 3]
    choice = api.completion_choice(gen, 0, TOK, done, "c")
    assert choice["prompt_routed_experts"] == routing[:3].tolist()
    assert choice["routed_experts"] == routing[3:].tolist()
    assert "prompt_routed_experts" not in api.completion_choice(_parse(), 0, TOK, done, "c")


def test_return_token_ids_gives_the_prompt_ids_where_vllm_puts_them():
    """vLLM's `return_token_ids`: a completion choice carries `prompt_token_ids` (its own prompt's,
    choice c of prompt c // n), a chat response carries them once at its top level."""
    done = type("Done", (), {})()
    done.tokens, done.logprobs, done.versions = [7, 8], [-1.0, -2.0], [0, 0]
    done.finish_reason, done.routing, done.prompt = "length", None, [1, 2, 3]
    batch = api.parse_completion(
        {"prompt": ["ab", [5, 6]], "n": 2, "return_token_ids": True}, tok=TOK, served="m", max_len=64, vocab=2048
    )
    ab = [TOK.bos_id, *TOK.encode("ab")]  # a text prompt starts with <|bos|>, as documents do in training
    assert [api.completion_choice(batch, c, TOK, done, "c")["prompt_token_ids"] for c in range(4)] == [
        ab,
        ab,
        [5, 6],
        [5, 6],
    ]
    assert api.response_fields(batch) == {}
    plain = _parse()
    assert "prompt_token_ids" not in api.completion_choice(plain, 0, TOK, done, "c") and not plain.return_token_ids
    chat = api.parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True},
        tok=TOK,
        served="m",
        max_len=64,
        vocab=2048,
    )
    ids = api.response_fields(chat)["prompt_token_ids"]
    assert TOK.decode(ids) == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "prompt_token_ids" not in api.completion_choice(chat, 0, TOK, done, "c")
    with pytest.raises(api.ApiError, match=r"return_token_ids.*'yes' is not a boolean"):
        _parse(return_token_ids="yes")


def test_prompt_logprobs_zero_only_and_not_streamed():
    """vLLM's prompt_logprobs: 0 (the prompt tokens' own) is accepted on completions; top
    alternatives and streaming are refused naming the field (vLLM refuses the stream too)."""
    assert _parse(prompt_logprobs=0).prompt_logprobs and not _parse().prompt_logprobs
    with pytest.raises(api.ApiError, match="prompt_logprobs.*2 alternatives per prompt token.*accepted: 0"):
        _parse(prompt_logprobs=2)
    with pytest.raises(api.ApiError, match="prompt_logprobs are not available with stream=true"):
        _parse(prompt_logprobs=0, stream=True)

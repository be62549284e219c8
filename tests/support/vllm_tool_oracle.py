"""vLLM's own tool parsers as an oracle for formats/tool_calls.py. Run under vLLM's python
(.venv/vllm/bin/python), which is not the project's interpreter.

  .venv/vllm/bin/python tests/support/vllm_tool_oracle.py < cases.json    -> outputs as JSON on stdout
  .venv/vllm/bin/python tests/support/vllm_tool_oracle.py --write         -> the corpus's outputs into
                                                     tests/fixtures/tool_calls/vllm_oracle.json

A case is {"syntax", "name", "text", "tools": bool}; its output is {"tools_called", "content",
"tool_calls": [{"name", "arguments"}]} from `extract_tool_calls(text, request)`, or {"error": ...}
when the parser raised. The parsers need a tokenizer only for its vocabulary (the syntax's special
tokens as single ids): a character-level WordLevel tokenizer with those tokens added is enough.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = HERE.parent / "fixtures" / "tool_calls" / "vllm_oracle.json"
PARSERS = {"hermes": "hermes", "qwen3_coder": "qwen3_coder", "deepseek_v3": "deepseek_v3", "kimi_k2": "kimi_k2"}
SPECIAL_TOKENS = [
    "<tool_call>", "</tool_call>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
]  # fmt: skip


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{chr(i): i - 31 for i in range(32, 127)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tok


def run(cases: list[dict]) -> list[dict]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    sys.path.insert(0, str(HERE))
    from tool_call_corpus import TOOLS

    logging.disable(logging.CRITICAL)  # parsers log the exceptions they swallow
    tok = _tokenizer()
    out: list[dict] = []
    for case in cases:
        tools = TOOLS if case["tools"] else None
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], model="m", tools=tools)
        parser = ToolParserManager.get_tool_parser(PARSERS[case["syntax"]])(tok, request.tools)
        try:
            got = parser.extract_tool_calls(case["text"], request)
        except Exception as exc:  # noqa: BLE001 - the oracle reports what the parser did
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        # ids vLLM makes up are random (chatcmpl-tool-...): kept only where the text carries one
        calls = [
            {
                "id": None if c.id.startswith("chatcmpl-") else c.id,
                "name": c.function.name,
                "arguments": c.function.arguments,
            }
            for c in got.tool_calls
        ]
        out.append({"tools_called": got.tools_called, "content": got.content, "tool_calls": calls})
    return out


def main() -> None:
    if "--write" in sys.argv:
        sys.path.insert(0, str(HERE))
        from tool_call_corpus import cases

        corpus = cases()
        doc: dict[str, list] = {"cases": corpus, "outputs": run(corpus)}
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {len(corpus)} cases to {FIXTURE}")
        return
    json.dump(run(json.load(sys.stdin)), sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()

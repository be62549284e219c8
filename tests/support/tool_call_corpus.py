"""Generated assistant turns per tool-call syntax, shared by the vLLM oracle script (run under vLLM's
own python, so this module imports nothing of the project) and tests/formats/test_tool_calls.py.

Each case: {"syntax", "name", "text", "tools": bool}. `tools` says whether the request carries
TOOLS (qwen3_coder converts parameter values by their schema types only then)."""

from __future__ import annotations

import json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "description": "edit a file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "line": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "dry": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "items": {"type": "array"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "shell",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    },
]

# (name, arguments) pairs the corpus writes in every syntax
_LS = ("shell", {"cmd": "ls -la"})
_READ = ("edit", {"path": "src/a.py", "line": 3})
_NESTED = ("edit", {"path": "docs/é.md", "opts": {"mode": "日本語", "deep": [1, {"x": None}]}, "items": ["a", "ü"]})
_UNKNOWN = ("frobnicate", {"level": 2})


def _args(a: dict) -> str:
    return json.dumps(a, ensure_ascii=False)


def hermes(*calls: tuple[str, dict]) -> str:
    return "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {_args(a)}}}\n</tool_call>' for n, a in calls)


def qwen3_coder(*calls: tuple[str, dict]) -> str:
    out = []
    for n, a in calls:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in a.items()
        )
        out.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
    return "\n".join(out)


def deepseek_v3(*calls: tuple[str, dict]) -> str:
    inner = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_args(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def kimi_k2(*calls: tuple[str, dict]) -> str:
    inner = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_args(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"


WRITERS = {"hermes": hermes, "qwen3_coder": qwen3_coder, "deepseek_v3": deepseek_v3, "kimi_k2": kimi_k2}
# what closes the last call of a turn (cut off for the "unterminated" case)
CLOSERS = {
    "hermes": "\n</tool_call>",
    "qwen3_coder": "\n</tool_call>",
    "deepseek_v3": "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_call_end|><|tool_calls_section_end|>",
}


def _cases_for(syntax: str) -> list[dict]:
    w = WRITERS[syntax]
    one, two = w(_LS), w(_LS, _READ)
    texts = {
        "no_call": "Just an answer, no tools.",
        "one_call": one,
        "two_calls": two,
        "content_before": "Let me look.\n\n" + one,
        "unknown_function": w(_UNKNOWN),
        "nested_unicode": w(_NESTED),
    }
    if syntax == "qwen3_coder":
        texts["malformed"] = "<tool_call>\n<function=shell>\n<parameter=cmd\nls\n</function>\n</tool_call>"
        texts["no_function_tag"] = "<tool_call>\nshell ls\n</tool_call>"
        texts["typed_params"] = w(("edit", {"path": "x", "line": 7, "ratio": 0.5, "dry": True, "items": [1, 2]}))
    else:
        broken = two.replace('"cmd": "ls -la"', '"cmd": "ls -la",,')
        texts["malformed"] = broken
    texts["unterminated"] = one.removesuffix(CLOSERS[syntax])
    texts["truncated_mid_argument"] = one[: one.index("ls -la") + 3]
    return [{"syntax": syntax, "name": k, "text": v, "tools": True} for k, v in texts.items()]


def cases() -> list[dict]:
    """The whole corpus, in a fixed order."""
    out = [c for s in WRITERS for c in _cases_for(s)]
    out.append({**out[0], "name": "no_call_no_tools", "tools": False})
    qwen_typed = next(c for c in out if c["name"] == "typed_params")
    out.append({**qwen_typed, "name": "typed_params_no_tools", "tools": False})
    return out

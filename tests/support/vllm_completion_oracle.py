"""vLLM's own response classes as an oracle for the shape of `serve`'s /v1/completions answers.
Run under vLLM's python (.venv/vllm/bin/python), which is not the project's interpreter.

  .venv/vllm/bin/python tests/support/vllm_completion_oracle.py < response.json

reads a /v1/completions response body, validates it with vLLM's `CompletionResponse` (pydantic:
a field of the wrong shape raises) and writes back, as JSON, each choice's `prompt_logprobs` as
vLLM's model holds it (token ids as its int keys, `Logprob` fields), so the caller can compare.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from vllm.entrypoints.openai.completion.protocol import CompletionResponse


def main() -> None:
    response = CompletionResponse.model_validate(json.load(sys.stdin))
    out = []
    for choice in response.choices:
        rows = choice.prompt_logprobs
        out.append(
            None
            if rows is None
            else [None if row is None else {int(t): dataclasses.asdict(lp) for t, lp in row.items()} for row in rows]
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

"""OpenAIPolicy against a local endpoint that rate-limits: the openai SDK retries 429 and 5xx
answers, waiting what Retry-After says, and the turn it returns is read from the final answer."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("openai")

from composer_jax.rl.samplers.policy import OpenAIPolicy, TurnRequest  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Reading.",
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
}


def _error(status: int) -> dict:
    kind = {429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": "busy", "type": kind, "param": None, "code": None}}


class _Endpoint:
    """Answers POST /v1/chat/completions with `script` statuses in turn (then 200 with ANSWER),
    recording each attempt's time, headers and body."""

    def __init__(self, script: list[tuple[int, dict[str, str]]]):
        self.script = list(script)
        self.attempts: list[Any] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                headers = {k.lower(): v for k, v in self.headers.items()}
                endpoint.attempts.append((time.monotonic(), headers, self.path, body))
                status, headers = endpoint.script.pop(0) if endpoint.script else (200, {})
                kind = {429: "rate_limit_error"}.get(status, "server_error")
                out = (
                    ANSWER
                    if status == 200
                    else {"error": {"message": "busy", "type": kind, "param": None, "code": None}}
                )
                data = json.dumps(out).encode()
                self.send_response(status)
                for k, v in {"content-type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def _turn(policy: OpenAIPolicy, messages: list[dict]):
    async def go():
        try:
            gen = policy.begin(messages)
            return gen, await policy.turn(gen, TurnRequest(max_tokens=32, seed=4, temperature=0.5))
        finally:
            await policy.aclose()

    return asyncio.run(go())


def test_429_with_retry_after_is_retried_after_the_wait_it_names():
    endpoint = _Endpoint([(429, {"retry-after": "1"}), (429, {"retry-after": "1"})])
    try:
        policy = OpenAIPolicy(endpoint.url, "m", api_key="k-123", tools=TOOLS, max_retries=3, timeout_s=30)
        gen, turn = _turn(policy, [{"role": "user", "content": "hi"}])
    finally:
        endpoint.close()
    times = [a[0] for a in endpoint.attempts]
    assert len(times) == 3  # two 429s, then the answer
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(0.9 <= g < 10 for g in gaps), gaps  # Retry-After: 1 honoured (not the SDK's 0.5 s first backoff)
    _, headers, path, body = endpoint.attempts[-1]
    assert path == "/v1/chat/completions" and headers["authorization"] == "Bearer k-123"
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["tools"] == TOOLS
    assert (body["model"], body["max_tokens"], body["seed"], body["temperature"]) == ("m", 32, 4, 0.5)
    # the turn as before: content, calls, the completion tokens counted, the message appended
    assert turn.content == "Reading." and turn.finished and turn.malformed == []
    assert turn.tool_calls == ANSWER["choices"][0]["message"]["tool_calls"]
    assert gen.generated == 7 and gen.messages[-1] == turn.message()


def test_5xx_past_the_retries_raises_naming_the_endpoint():
    endpoint = _Endpoint([(503, {})] * 3)
    try:
        policy = OpenAIPolicy(endpoint.url, "m", tools=TOOLS, max_retries=1, timeout_s=30)
        with pytest.raises(RuntimeError, match=r"policy endpoint http://127\.0\.0\.1:\d+/v1: HTTP 503: .*busy"):
            _turn(policy, [{"role": "user", "content": "hi"}])
    finally:
        endpoint.close()
    assert len(endpoint.attempts) == 2  # the first try and one retry
    assert endpoint.attempts[0][1]["authorization"] == "Bearer EMPTY"  # no key: the SDK's placeholder

"""`composer-jax serve` through the `openai` client, and `composer-jax sample`.

A tiny MoE (random init) saved as a training checkpoint, served in-process on a free port with the
shipped tokenizer. Log-probabilities are checked against the training forward over the same tokens
(an independent computation: no KV cache, no sampler), the tool-call path against hand-made tokens
and the template's own text, streams against the non-streamed response for the same seed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from support.metrics_scrape import scrape  # noqa: E402
from support.serve_thread import app_in_thread, stop_app  # noqa: E402

from composer_jax.checkpoint.manager import TrainCheckpointer  # noqa: E402
from composer_jax.cli import main as cli_main  # noqa: E402
from composer_jax.config import ConfigError, load_config, to_dict  # noqa: E402
from composer_jax.config.checkpoint import CheckpointConfig  # noqa: E402
from composer_jax.config.sampler import SamplerConfig  # noqa: E402
from composer_jax.formats.chatml import render_chat_text  # noqa: E402
from composer_jax.formats.tokenizer import load_tokenizer  # noqa: E402
from composer_jax.inference.engine.batch_sampler import Request  # noqa: E402
from composer_jax.inference.engine.token_sampling import SamplingParams  # noqa: E402
from composer_jax.inference.server import openai_api as api  # noqa: E402
from composer_jax.inference.server.cli import build_server, sample_main  # noqa: E402
from composer_jax.inference.server.policy import load_policy  # noqa: E402
from composer_jax.model.transformer import forward  # noqa: E402
from composer_jax.sharding import ShardingRules, make_mesh  # noqa: E402
from composer_jax.train.state import init_train_state  # noqa: E402

KEY = "test-key-0123456789abcdef"
MAX_LEN = 512
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


def _save(directory, seed: int):
    cfg = load_config(
        "configs/model/tiny.yaml",
        [
            "model.vocab_size=2048",
            "model.num_layers=2",
            "model.max_position_embeddings=512",
            "mesh.fsdp=1",
            "data.tokenizer=assets/tokenizer",
            f"train.seed={seed}",
        ],
        num_devices=None,
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = init_train_state(cfg, mesh, ShardingRules.create(cfg.sharding_rules))
    with TrainCheckpointer(CheckpointConfig(directory=str(directory), save_every=1)) as ck:
        ck.save(1, state, config=to_dict(cfg))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("ckpt_a"), tmp_path_factory.mktemp("ckpt_b")
    _save(a, 0)
    _save(b, 1)
    return a, b


@pytest.fixture(scope="module")
def served(ckpts):
    policy = load_policy(ckpts[0])
    tok = load_tokenizer(policy.tokenizer_hint)
    server, engine = build_server(
        policy, tok, sampler=SamplerConfig(slots=2, max_queued=1), max_len=MAX_LEN, api_key=KEY, model_name="tiny-test"
    )
    url, http, thread = app_in_thread(server.app)
    yield {"url": url, "server": server, "engine": engine, "policy": policy, "tok": tok}
    stop_app(http, thread)
    engine.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _reference_logprobs(params, cfg, prompt: list[int], tokens: list[int], temperature: float) -> np.ndarray:
    """The training forward over prompt + tokens: log softmax(logits / T) of each generated token."""
    seq = jnp.asarray([prompt + tokens], jnp.int32)
    logits = forward(params, seq, cfg).logits[0, len(prompt) - 1 : -1]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(tokens)[:, None], axis=-1)[:, 0])


def _post(served, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(served["url"] + path, content=data, headers=headers, timeout=120)


# ---------------------------------------------------------------------------- completions
def test_completion_logprobs_equal_the_training_forward_and_stream_matches(served, client):
    tok, policy = served["tok"], served["policy"]
    kw = dict(model="tiny-test", prompt="def add(a, b):", max_tokens=8, temperature=0.7, seed=11, logprobs=0)
    r = client.completions.create(**kw)
    (choice,) = r.choices
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 8 and choice.finish_reason == "length" and r.usage.completion_tokens == 8
    assert choice.text == tok.decode(ids, skip_special_tokens=True)
    assert choice.model_extra["token_versions"] == [0] * 8
    prompt = [tok.bos_id, *tok.encode("def add(a, b):")]
    assert r.usage.prompt_tokens == len(prompt)
    want = _reference_logprobs(policy.params, policy.cfg, prompt, ids, 0.7)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, want, atol=1e-5, rtol=0)
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ids]

    # the same seed streamed: chunks concatenate to the same text, tokens and log-probabilities
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    body = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in body) == choice.text
    assert sum((c.model_extra["token_ids"] for c in body), []) == ids
    assert sum((c.logprobs.token_logprobs for c in body if c.logprobs), []) == choice.logprobs.token_logprobs
    assert [c.finish_reason for c in body][-1] == "length" and len(body) > 2  # token by token


def _prompt_logprobs_response(served) -> tuple[dict, list[int]]:
    tok = served["tok"]
    prompt = [tok.bos_id, *tok.encode("def add(a, b):\n    return a + b")]
    r = _post(
        served,
        "/v1/completions",
        {"model": "tiny-test", "prompt": prompt, "max_tokens": 1, "n": 2, "temperature": 0, "prompt_logprobs": 0},
    )
    assert r.status_code == 200, r.text
    return r.json(), prompt


def test_prompt_logprobs_equal_the_training_forward(served):
    """vLLM's prompt_logprobs (what a distillation teacher answers): per choice, None for the first
    prompt token, then {token id: {logprob, rank, decoded_token}} of the prompt token at each
    position, from the raw logits (no temperature), equal to a plain forward's log softmax."""
    tok, policy = served["tok"], served["policy"]
    body, prompt = _prompt_logprobs_response(served)
    seq = jnp.asarray([prompt], jnp.int32)
    logits = jax.jit(lambda p: forward(p, seq, policy.cfg).logits[0, :-1].astype(jnp.float32))(policy.params)
    lp = np.asarray(jax.nn.log_softmax(logits))
    want = lp[np.arange(len(prompt) - 1), prompt[1:]]
    want_rank = 1 + (lp > want[:, None]).sum(axis=1)
    for choice in body["choices"]:
        rows = choice["prompt_logprobs"]
        assert len(rows) == len(prompt) and rows[0] is None
        assert [list(r) for r in rows[1:]] == [[str(t)] for t in prompt[1:]]
        got = [r[str(t)] for r, t in zip(rows[1:], prompt[1:])]
        np.testing.assert_allclose([g["logprob"] for g in got], want, atol=1e-5, rtol=0)
        assert [g["rank"] for g in got] == want_rank.tolist()
        assert [g["decoded_token"] for g in got] == [tok.decode([t]) for t in prompt[1:]]
    # without the field: no prompt_logprobs key (as before)
    plain = _post(served, "/v1/completions", {"model": "tiny-test", "prompt": prompt, "max_tokens": 1, "n": 2})
    assert "prompt_logprobs" not in plain.json()["choices"][0]


@pytest.mark.slow
def test_prompt_logprobs_have_vllms_response_shape(served):
    """The response validated by vLLM's own `CompletionResponse` (about 20 s to import vLLM): its
    prompt_logprobs read back as vLLM holds them equal ours. The default test
    test_prompt_logprobs_equal_the_training_forward keeps the documented shape."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[3]
    python = root / ".venv" / "vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM interpreter at .venv/vllm/bin/python ({python}): the oracle cannot run")
    body, _ = _prompt_logprobs_response(served)
    done = subprocess.run(
        [str(python), str(root / "tests" / "support" / "vllm_completion_oracle.py")],
        input=json.dumps(body),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(done.stdout) == [c["prompt_logprobs"] for c in body["choices"]]


def test_token_id_prompts_n_choices_stop_strings_and_routing(served, client):
    tok = served["tok"]
    prompt = [tok.bos_id, *tok.encode("import os\n")]
    r = client.completions.create(
        model="tiny-test",
        prompt=prompt,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"return_routing": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    a, b = (c.model_extra for c in r.choices)
    assert a["token_ids"] != b["token_ids"]  # seeds 5 and 6
    cfg = served["policy"].cfg
    moe_layers = cfg.num_layers - cfg.first_k_dense
    routing = np.asarray(a["routed_experts"])
    assert routing.shape == (5, moe_layers, cfg.num_experts_per_tok)  # generated tokens but the last
    assert routing.min() >= 0 and routing.max() < cfg.num_experts

    # the next turn (the conversation so far and more): the engine reuses choice 0's cached prefix
    # (prompt + its tokens but the last) and prefills the rest; the answer is the training forward's
    before = httpx.get(served["url"] + "/health").json()["prefix"]
    turn = prompt + a["token_ids"] + tok.encode("\n")
    r3 = client.completions.create(
        model="tiny-test",
        prompt=turn,
        max_tokens=4,
        temperature=1.0,
        seed=9,
        logprobs=0,
        extra_body={"return_routing": True, "return_prompt_routing": True},
    )
    after = httpx.get(served["url"] + "/health").json()
    assert after["prefix_cache"] == "version"
    assert after["warm_up_s"] == 0.0 and 0 < after["prefill_trace_s"] <= after["prefill_s"]  # no --warm-up here
    assert after["process_cpu_s"] > 0
    assert after["prefix"]["reused"] - before["reused"] == len(prompt) + 5
    assert after["prefix"]["prefilled"] - before["prefilled"] == len(turn) - len(prompt) - 5
    (c3,) = r3.choices
    want = _reference_logprobs(served["policy"].params, cfg, turn, c3.model_extra["token_ids"], 1.0)
    np.testing.assert_allclose(c3.logprobs.token_logprobs, want, atol=1e-5, rtol=0)
    full = np.asarray(c3.model_extra["prompt_routed_experts"] + c3.model_extra["routed_experts"])
    seq = jnp.asarray([turn + c3.model_extra["token_ids"]], jnp.int32)
    fresh = forward(served["policy"].params, seq, cfg).routing[:, 0, :-1]
    np.testing.assert_array_equal(full, np.asarray(fresh).transpose(1, 0, 2))  # reused positions' routing too

    # a stop string cut out of the text, as OpenAI does; the stream holds back its prefix
    text = tok.decode(a["token_ids"], skip_special_tokens=True)
    stop = text[3:5]
    kw = dict(model="tiny-test", prompt=prompt, max_tokens=6, temperature=1.0, seed=5, stop=[stop])
    r2 = client.completions.create(**kw)
    assert r2.choices[0].text == text[: text.find(stop)] and r2.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == r2.choices[0].text


def test_long_streams_concatenate_to_the_non_streamed_text(served, client):
    # long enough for the stream's incremental decoding to restart from a cached prefix many times
    kw = dict(model="tiny-test", prompt="class A:", max_tokens=200, temperature=1.0, seed=9)
    text = client.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == text
    chat = dict(model="tiny-test", messages=[{"role": "user", "content": "hi"}], max_tokens=150, seed=4)
    content = client.chat.completions.create(**chat).choices[0].message.content or ""
    assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)) == (
        content
    )


# ---------------------------------------------------------------------------- chat and tools
def test_tools_are_rendered_into_the_prompt_as_the_template_says(served):
    tok = served["tok"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Show a.py"}]
    gen = api.parse_chat({"messages": messages, "tools": TOOLS}, tok=tok, served="m", max_len=MAX_LEN * 100, vocab=2048)
    fn = json.dumps(TOOLS[0]["function"], separators=(", ", ": "))
    expected = (
        "<|bos|><|im_start|>system\nBe brief.\n\n# Tools\n" + fn + "\n<|im_end|>\n"
        "<|im_start|>user\nShow a.py<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(gen.prompts[0]) == expected
    assert render_chat_text(messages, TOOLS).removesuffix("<|eos|>") == expected.removesuffix("<|im_start|>assistant\n")
    # no system message: one holding only the tools block comes first
    gen = api.parse_chat({"messages": messages[1:], "tools": TOOLS}, tok=tok, served="m", max_len=10**4, vocab=2048)
    assert tok.decode(gen.prompts[0]).startswith("<|bos|><|im_start|>system\n# Tools\n" + fn + "\n<|im_end|>\n")


def test_generated_tool_calls_come_back_as_openai_tool_calls(served):
    tok = served["tok"]
    call = tok.token_id("<|tool_call|>")
    tokens = [
        *tok.encode("Reading it."),
        call,
        *tok.encode('{"name": "read_file", "arguments": {"path": "a.py"}}'),
        call,
        *tok.encode('{"name": oops}'),
        tok.token_id("<|im_end|>"),
    ]
    gen = api.parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "logprobs": True},
        tok=tok,
        served="m",
        max_len=MAX_LEN,
        vocab=2048,
    )
    choice = api.build_choice(
        gen,
        0,
        tok,
        tokens=tokens,
        logprobs=[-0.5] * len(tokens),
        versions=[3] * len(tokens),
        finish_reason="stop",
        routing=None,
        prompt_len=4,
        call_id_prefix="call_x",
    )
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    parsed = openai.types.chat.ChatCompletion.model_validate(body)  # the client's own schema
    (c,) = parsed.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "Reading it."
    (tc,) = c.message.tool_calls
    assert (tc.id, tc.function.name, json.loads(tc.function.arguments)) == ("call_x_0", "read_file", {"path": "a.py"})
    assert len(choice["malformed_tool_calls"]) == 1 and "tool call 1" in choice["malformed_tool_calls"][0]
    assert [e.token for e in c.logprobs.content][-1] == "<|im_end|>" and len(c.logprobs.content) == len(tokens)
    assert bytes(c.logprobs.content[0].bytes) == tok.decode([tokens[0]]).encode()


def test_chat_with_tools_end_to_end(served, client):
    tok, policy = served["tok"], served["policy"]
    messages = [{"role": "user", "content": "List the files."}]
    kw = dict(model="tiny-test", messages=messages, tools=TOOLS, max_tokens=10, temperature=0.8, seed=2, logprobs=True)
    r = client.chat.completions.create(**kw)
    (c,) = r.choices
    ids = c.model_extra["token_ids"]
    turn = api.turn_of(tok, ids, "unused")
    assert c.message.content == (turn.content or None)
    assert [t.function.name for t in c.message.tool_calls or []] == [t["function"]["name"] for t in turn.tool_calls]
    assert c.model_extra["malformed_tool_calls"] == turn.malformed
    prompt = api.parse_chat({"messages": messages, "tools": TOOLS}, tok=tok, served="m", max_len=MAX_LEN, vocab=2048)
    want = _reference_logprobs(policy.params, policy.cfg, prompt.prompts[0], ids, 0.8)
    np.testing.assert_allclose([e.logprob for e in c.logprobs.content], want, atol=1e-5, rtol=0)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert content == (c.message.content or "")
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks[1:]), []) == ids
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_return_token_ids_gives_the_prompt_as_the_model_saw_it(served, client):
    """vLLM's `return_token_ids` (what a user checks a template with): completions put the prompt's
    ids on the choice, chat at the response's top level; a stream sends them in its first chunk."""
    tok = served["tok"]
    ask = {"return_token_ids": True}
    r = client.completions.create(model="tiny-test", prompt="def f():", max_tokens=2, extra_body=ask)
    want = [tok.bos_id, *tok.encode("def f():")]
    assert r.choices[0].model_extra["prompt_token_ids"] == want
    body = {"prompt": "def f():", "max_tokens": 3, "stream": True, **ask}
    chunks = _sse(served, "/v1/completions", body)
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks] == [want] + [None] * (len(chunks) - 1)

    messages = [{"role": "user", "content": "Show a.py"}]
    fn = json.dumps(TOOLS[0]["function"], separators=(", ", ": "))
    rendered = (
        "<|bos|><|im_start|>system\n# Tools\n" + fn + "\n<|im_end|>\n"
        "<|im_start|>user\nShow a.py<|im_end|>\n<|im_start|>assistant\n"
    )
    kw = dict(model="tiny-test", messages=messages, tools=TOOLS, max_tokens=2)
    c = client.chat.completions.create(**kw, extra_body=ask)
    ids = c.model_extra["prompt_token_ids"]
    assert tok.decode(ids) == rendered and c.usage.prompt_tokens == len(ids)
    assert "prompt_token_ids" not in c.choices[0].model_extra
    assert "prompt_token_ids" not in client.chat.completions.create(**kw).model_extra
    chunks = _sse(
        served, "/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 3, "stream": True, **ask}
    )
    assert [ch.get("prompt_token_ids") for ch in chunks] == [ids] + [None] * (len(chunks) - 1)


# ---------------------------------------------------------------------------- OpenAI conformance
def _sse(served, path: str, body: dict) -> list[dict]:
    """A streamed response's chunks as JSON (raw SSE: no client in between)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", served["url"] + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_text_offsets_continue_across_chunks(served):
    body = {"model": "tiny-test", "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 1.0, "seed": 3}
    r = _post(served, "/v1/completions", {**body, "logprobs": 0})
    whole = openai.types.Completion.model_validate(r.json()).choices[0]
    raw = _sse(served, "/v1/completions", {**body, "logprobs": 0, "stream": True})
    # the SDK's Completion allows no null finish_reason, which the API streams before the last chunk
    assert [c["choices"][0]["finish_reason"] for c in raw] == [None] * (len(raw) - 1) + ["length"]
    last = [{**c, "choices": [{**c["choices"][0], "finish_reason": "length"}]} for c in raw]
    chunks = [openai.types.Completion.model_validate(c) for c in last]
    assert all(c.object == "text_completion" and len(c.choices) == 1 for c in chunks) and len(chunks) > 2
    offsets = sum((c.choices[0].logprobs.text_offset for c in chunks if c.choices[0].logprobs), [])
    assert offsets == whole.logprobs.text_offset and len(offsets) == 24
    # offsets into the whole completion: each token's text starts where the one before ended
    pieces = whole.logprobs.tokens
    assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]


def test_forced_tool_choice_end_to_end(served):
    tok, policy = served["tok"], served["policy"]
    messages = [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Show a.py"}]
    named = {"type": "function", "function": {"name": "read_file"}}
    body = {"model": "tiny-test", "messages": messages, "tools": TOOLS, "max_tokens": 12, "seed": 8}
    base = api.parse_chat(
        {**body, "messages": [{"role": "system", "content": "Use tools."}, messages[1]]},
        tok=tok,
        served="tiny-test",
        max_len=MAX_LEN,
        vocab=2048,
    )
    for choice in ("required", named):
        gen = api.parse_chat({**body, "tool_choice": choice}, tok=tok, served="tiny-test", max_len=MAX_LEN, vocab=2048)
        r = _post(served, "/v1/chat/completions", {**body, "tool_choice": choice, "logprobs": True})
        completion = openai.types.chat.ChatCompletion.model_validate(r.json())
        (c,) = completion.choices
        ids = c.model_extra["token_ids"]
        # the forced opening is prompt: counted there, and the model sampled after it
        assert gen.prompts[0] == base.prompts[0] + gen.forced  # developer is rendered as system
        assert completion.usage.prompt_tokens == len(gen.prompts[0]) and completion.usage.completion_tokens == len(ids)
        want = _reference_logprobs(policy.params, policy.cfg, gen.prompts[0], ids, 1.0)
        np.testing.assert_allclose([e.logprob for e in c.logprobs.content], want, atol=1e-5, rtol=0)
        turn = api.turn_of(tok, gen.forced + ids, "unused")  # read after the forced opening
        assert c.message.content is None and c.model_extra["malformed_tool_calls"] == turn.malformed
        assert [t.function.name for t in c.message.tool_calls or []] == [t["function"]["name"] for t in turn.tool_calls]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert len(turn.tool_calls) + len(turn.malformed) >= 1  # the turn holds a call, whole or not

        # streamed: every chunk is a ChatCompletionChunk; the SDK's accumulation gives the same turn
        chunks = _sse(served, "/v1/chat/completions", {**body, "tool_choice": choice, "stream": True})
        state = openai.lib.streaming.chat.ChatCompletionStreamState(input_tools=TOOLS)
        for chunk in chunks:
            assert chunk["object"] == "chat.completion.chunk"
            state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(chunk))
        final = state.current_completion_snapshot.choices[0]  # (get_final_completion refuses "length")
        assert final.finish_reason == c.finish_reason and (final.message.content or None) is None
        assert [t.function.name for t in final.message.tool_calls or []] == [
            t.function.name for t in c.message.tool_calls or []
        ]


def test_openai_sdk_stream_helper_reads_a_chat_stream(served, client):
    kw = dict(model="tiny-test", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=20, seed=6)
    whole = client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw, stream_options={"include_usage": True}) as stream:
        for _ in stream:  # the SDK's own events, accumulated by it
            pass
        final = stream.current_completion_snapshot
    (a,), (b,) = whole.choices, final.choices
    assert (b.message.content or None) == a.message.content and b.finish_reason == a.finish_reason
    assert final.usage.completion_tokens == whole.usage.completion_tokens == len(a.model_extra["token_ids"])


# ---------------------------------------------------------------------------- errors, auth, limits
def _error_of(response: httpx.Response) -> dict:
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_bad_requests_get_4xx_naming_the_value(served, client):
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens", "-3 is out of range"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "-1 is out of range"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "99999"),
        ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs", "3 alternatives"),
        ("/v1/completions", {"prompt": "word " * 600}, "prompt", "server's context is 512 tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 511}, "max_tokens", "accepted: max_tokens <= 510"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages", "role 'bot'"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages", "non-empty list"),
        ("/v1/chat/completions", {"messages": user, "tools": [{"type": "function"}]}, "tools", "tools[0]"),
        (
            "/v1/chat/completions",
            {"messages": user, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools",
            "'bad name!'",
        ),
        ("/v1/chat/completions", {"messages": user, "tool_choice": "always", "tools": TOOLS}, "tool_choice", "auto"),
        ("/v1/chat/completions", {"messages": user, "n": 0}, "n", "0 is out of range"),
    ]
    for path, body, param, text in cases:
        r = _post(served, path, {"model": "tiny-test", **body})
        err = _error_of(r)
        assert r.status_code == 400 and err["param"] == param and text in err["message"], (body, err)
    r = _post(served, "/v1/completions", b"{not json")
    assert r.status_code == 400 and "not valid JSON" in _error_of(r)["message"]
    r = httpx.get(served["url"] + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "/v1/chat/completions" in _error_of(r)["message"]


def test_auth(served):
    url = served["url"]
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/v1/completions", "/admin/load_weights"):
        for key in (None, "wrong-key-0123456789"):
            r = _post(served, path, {"prompt": "x"}, key=key) if path != "/v1/models" else httpx.get(url + path)
            assert r.status_code == 401 and _error_of(r)["code"] == "invalid_api_key", (path, key)
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"] == (
        "tiny-test"
    )


def test_full_server_answers_429_and_a_dropped_stream_frees_its_slots(served, client):
    # capacity: 2 slots + max_queued 1
    with pytest.raises(openai.RateLimitError, match="do not fit"):
        client.completions.create(model="tiny-test", prompt="x", max_tokens=4, n=4)
    stream = client.completions.create(model="tiny-test", prompt="x", max_tokens=80, n=3, stream=True, seed=0)
    next(iter(stream))  # the three are in the engine now
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(model="tiny-test", prompt="x", max_tokens=2)
    assert exc.value.status_code == 429 and exc.value.body["code"] == "queue_full"
    stream.close()  # the client goes away: its requests are cancelled
    for _ in range(100):
        if served["engine"].outstanding == 0:
            break
        time.sleep(0.05)
    assert served["engine"].outstanding == 0
    assert client.completions.create(model="tiny-test", prompt="x", max_tokens=2).choices[0].finish_reason == "length"


def test_429_carries_retry_after_and_401_is_openai_s(served, client):
    r = _post(served, "/v1/completions", {"model": "tiny-test", "prompt": "x", "max_tokens": 2, "n": 4})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    err = _error_of(r)
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "retry in 1 s" in err["message"]
    r = _post(served, "/v1/completions", {"prompt": "x"}, key="wrong-key-0123456789")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert {k: _error_of(r)[k] for k in ("type", "param", "code")} == {
        "type": "invalid_request_error",  # what the real API answers for a wrong key
        "param": None,
        "code": "invalid_api_key",
    }
    wrong = openai.OpenAI(base_url=served["url"] + "/v1", api_key="wrong-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        wrong.models.list()
    assert exc.value.code == "invalid_api_key" and exc.value.type == "invalid_request_error"


# ---------------------------------------------------------------------------- metrics
def test_metrics_scrape(served, client):
    """GET /metrics read with prometheus_client's own parser: families, types and label sets, and
    counts that moved by exactly what was served between two scrapes (token counters equal the
    responses' usage; requests by endpoint and status, 401 and 404 included; one first-token time
    per choice), the slot and queue gauges under load, the weight version and updates."""
    engine = served["engine"]
    http = httpx.Client(base_url=served["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    before = scrape(http)
    plain = client.completions.create(model="tiny-test", prompt="def add(a, b):", max_tokens=7, temperature=0)
    chat = client.chat.completions.create(
        model="tiny-test", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    chunks = list(
        client.completions.create(
            model="tiny-test", prompt="def f():", max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = chunks[-1].usage
    assert streamed is not None
    assert httpx.get(served["url"] + "/metrics").status_code == 401  # the key is needed, as everywhere
    assert http.get("/v1/nothing").status_code == 404
    # a request is counted once its response has been sent (timed to its end): the client may read
    # the answer first, so scrape again until the last two requests are in (each scrape counts too)
    after, scrapes = scrape(http), 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        after.delta(before, "cj_serve_requests_total", endpoint="other", status="404") < 1
        or after.delta(before, "cj_serve_requests_total", endpoint="/metrics", status="401") < 1
    ):
        time.sleep(0.05)
        after, scrapes = scrape(http), scrapes + 1

    usages = [plain.usage, chat.usage, streamed]
    assert all(u is not None for u in usages)
    generated = after.delta(before, "cj_serve_generation_tokens_total")
    assert generated == sum(u.completion_tokens for u in usages if u is not None)
    assert after.delta(before, "cj_serve_prompt_tokens_total") == sum(u.prompt_tokens for u in usages if u)
    requests = {
        ("/v1/completions", "200"): 2,
        ("/v1/chat/completions", "200"): 1,
        ("/metrics", "200"): 1 + scrapes,  # the first scrape (and any repeated above), counted once answered
        ("/metrics", "401"): 1,
        ("other", "404"): 1,
    }
    for (endpoint, status), n in requests.items():
        assert after.delta(before, "cj_serve_requests_total", endpoint=endpoint, status=status) == n
    assert after.delta(before, "cj_serve_request_seconds_count", endpoint="/v1/completions") == 2
    assert after.delta(before, "cj_serve_time_to_first_token_seconds_count") == 3  # one per choice
    ttft = after.delta(before, "cj_serve_time_to_first_token_seconds_sum")
    latency = sum(
        after.delta(before, "cj_serve_request_seconds_sum", endpoint=e)
        for e in ("/v1/completions", "/v1/chat/completions")
    )
    assert 0 < ttft < latency
    # where the requests' time went (the RL profile's counters: runtime/profile.py): the prefills are a
    # part of the engine steps; the handlers tokenised and JSON-coded; the event loop's thread ran
    assert (
        0
        < after.delta(before, "cj_serve_prefill_seconds_total")
        < after.delta(before, "cj_serve_engine_step_seconds_total")
    )
    assert after.delta(before, "cj_serve_tokenize_seconds_total") > 0
    assert after.delta(before, "cj_serve_http_seconds_total") > 0
    assert after.delta(before, "cj_serve_http_thread_cpu_seconds_total") > 0
    assert {
        "cj_serve_requests": "counter",
        "cj_serve_request_seconds": "histogram",
        "cj_serve_time_to_first_token_seconds": "histogram",
        "cj_serve_generation_tokens": "counter",
        "cj_serve_prompt_tokens": "counter",
        "cj_serve_prompt_tokens_reused": "counter",
        "cj_serve_slots": "gauge",
        "cj_serve_slots_in_use": "gauge",
        "cj_serve_requests_waiting": "gauge",
        "cj_serve_weight_version": "gauge",
        "cj_serve_weight_updates": "counter",
        "cj_serve_recent_generation_tokens_per_second": "gauge",
        "cj_serve_model_info": "gauge",  # an Info, which the text format writes as a gauge of 1
        "cj_serve_prefill_seconds": "counter",
        "cj_serve_tokenize_seconds": "counter",
        "cj_serve_http_seconds": "counter",
        "cj_serve_http_thread_cpu_seconds": "counter",
    }.items() <= after.types.items()
    assert after.labels["cj_serve_requests_total"] == {("endpoint", "status")}
    assert after.labels["cj_serve_request_seconds_bucket"] == {("endpoint", "le")}
    assert after("cj_serve_model_info", model="tiny-test", max_len=str(MAX_LEN), slots="2") == 1
    assert after("cj_serve_slots") == 2 and after("cj_serve_slots_in_use") == 0
    assert after("cj_serve_requests_waiting") == 0 and after("cj_serve_recent_generation_tokens_per_second") >= 0

    # under load: 2 slots busy, 1 request queued (capacity 2 + max_queued 1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 8)
    engine.submit([Request([1, 2, 3], params, id=f"load-{i}") for i in range(3)], lambda ev: None)
    try:
        deadline, busy = time.monotonic() + 60, scrape(http)
        while busy("cj_serve_slots_in_use") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
            busy = scrape(http)
        assert busy("cj_serve_slots_in_use") == 2 and busy("cj_serve_requests_waiting") == 1
    finally:
        engine.cancel([f"load-{i}" for i in range(3)])
    for _ in range(200):
        if engine.outstanding == 0:
            break
        time.sleep(0.05)
    version, swaps = engine.version, scrape(http)
    assert swaps("cj_serve_weight_version") == version
    assert engine.update_weights(engine.sampler.params, version + 1).result(60) == version
    swapped = scrape(http)
    assert swapped.delta(swaps, "cj_serve_weight_updates_total") == 1
    assert swapped("cj_serve_weight_version") == version + 1
    assert swapped("cj_serve_slots_in_use") == 0 and swapped("cj_serve_requests_waiting") == 0


# ---------------------------------------------------------------------------- weights
def test_weight_swap_mid_generation_in_the_engine(served, ckpts):
    # the swap is asked for by the request's own listener when its 5th token arrives (the engine
    # thread calls listeners between steps), so it lands at a known token
    engine, other = served["engine"], load_policy(ckpts[1])
    start, events = engine.version, []

    def listen(ev):
        events.append(ev)
        if sum(len(e.tokens) for e in events) == 5 and ev.completion is None:
            engine.update_weights(other.params, start + 1)

    done = threading.Event()
    engine.submit(
        [Request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=30), id="swap-test")],
        lambda ev: (listen(ev), done.set() if ev.completion or ev.error else None),
        stream=True,
    )
    assert done.wait(120)
    final = events[-1].completion
    assert final is not None and final.finish_reason == "length" and len(final.tokens) == 30  # it ran on
    assert final.versions == [start] * 5 + [start + 1] * 25
    assert sum((e.tokens for e in events[:-1]), []) == final.tokens[: sum(len(e.tokens) for e in events[:-1])]
    assert engine.version == start + 1


def test_admin_load_weights(served, client, ckpts):
    engine = served["engine"]
    start = engine.version
    # long enough to outlast the checkpoint read on most machines; the assertions hold either way
    stream = client.completions.create(model="tiny-test", prompt="x", max_tokens=500, temperature=0, stream=True)
    it = iter(stream)
    versions = list(next(it).choices[0].model_extra["token_versions"])
    bad = _post(served, "/admin/load_weights", {"checkpoint": str(ckpts[1]), "version": start})
    assert bad.status_code == 400 and _error_of(bad)["param"] == "version"
    assert f"accepted: >= {start + 1}" in _error_of(bad)["message"]
    bad = _post(served, "/admin/load_weights", {"checkpoint": str(ckpts[1]), "source": "weight_sync"})
    assert bad.status_code == 400 and "accepted: ['checkpoint', 'weight_store']" in _error_of(bad)["message"]
    bad = _post(served, "/admin/load_weights", {"checkpoint": str(ckpts[1]) + "/nope"})
    assert bad.status_code == 400 and _error_of(bad)["param"] == "checkpoint"
    r = _post(served, "/admin/load_weights", {"checkpoint": str(ckpts[1]), "version": start + 5})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == start + 5 and r.json()["previous_version"] == start and r.json()["step"] == 1
    rest = list(it)
    versions += sum((c.choices[0].model_extra["token_versions"] for c in rest), [])
    assert rest[-1].choices[0].finish_reason == "length" and len(versions) == 500  # the request ran on
    k = versions.index(start + 5) if start + 5 in versions else 500
    assert versions == [start] * k + [start + 5] * (500 - k)
    assert httpx.get(served["url"] + "/health").json()["policy_version"] == start + 5
    r = client.completions.create(model="tiny-test", prompt="x", max_tokens=2)
    assert r.choices[0].model_extra["token_versions"] == [start + 5] * 2
    # back to the first checkpoint's weights for the other tests (version defaults to current + 1)
    assert _post(served, "/admin/load_weights", {"checkpoint": str(ckpts[0])}).json()["version"] == start + 6


def test_admin_refuses_another_architecture(served, tmp_path):
    import dataclasses

    from composer_jax.hf.weights import save_pretrained
    from composer_jax.model.params import init_params

    cfg = dataclasses.replace(served["policy"].cfg, num_layers=3)
    hf_dir = save_pretrained(init_params(cfg, jax.random.key(0)), cfg, tmp_path / "hf")
    version = served["engine"].version
    r = _post(served, "/admin/load_weights", {"checkpoint": str(hf_dir)})
    err = _error_of(r)
    assert r.status_code == 409 and err["code"] == "model_mismatch" and "model.num_layers: 2 -> 3" in err["message"]
    assert served["engine"].version == version


def test_engine_failure_fails_the_request_with_500_and_keeps_serving(served, client):
    engine = served["engine"]
    version = engine.version
    # weights of shapes the decode program cannot take (the admin endpoint would refuse them),
    # swapped in while nothing runs: the next request's first step fails
    broken = jax.tree.map(lambda x: x[..., :1], engine.sampler.params)
    assert engine.update_weights(broken, version + 1).result(timeout=60) == version
    with pytest.raises(openai.InternalServerError, match="the inference engine failed") as exc:
        client.completions.create(model="tiny-test", prompt="x", max_tokens=3)
    assert exc.value.status_code == 500 and exc.value.body["code"] == "engine_error"
    assert engine.version == version  # the last weights that ran are back
    r = client.completions.create(model="tiny-test", prompt="x", max_tokens=2)
    assert r.choices[0].model_extra["token_versions"] == [version, version]
    assert httpx.get(served["url"] + "/health").json()["engine_failures"] == 1


# ---------------------------------------------------------------------------- sample CLI
def test_sample_cli(ckpts, served, capsys):
    tok, policy = served["tok"], served["policy"]
    args = ["--checkpoint", str(ckpts[0]), "--max-len", "64", "--max-tokens", "5", "--temperature", "0"]
    assert sample_main([*args, "--prompt", "def f():", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (choice,) = out["choices"]
    prompt = [tok.bos_id, *tok.encode("def f():")]
    seq = jnp.asarray([prompt + choice["token_ids"]], jnp.int32)
    greedy = np.asarray(jnp.argmax(forward(policy.params, seq, policy.cfg).logits[0, len(prompt) - 1 : -1], -1))
    assert choice["token_ids"] == greedy.tolist()
    assert "prompt_token_ids" not in choice
    assert sample_main([*args, "--prompt", "def f():"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == choice["text"]
    # the prompt's ids on request, where vLLM's return_token_ids puts them (completions: the choice)
    assert sample_main([*args, "--prompt", "def f():", "--json", "--return-token-ids"]) == 0
    assert json.loads(capsys.readouterr().out)["choices"][0]["prompt_token_ids"] == prompt
    assert sample_main([*args, "--prompt", "hi", "--chat", "--json", "--return-token-ids"]) == 0
    chat_ids = json.loads(capsys.readouterr().out)["prompt_token_ids"]  # chat: the response's top level
    assert tok.decode(chat_ids) == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert sample_main([*args, "--prompt", "def f():", "--return-token-ids"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"[prompt token ids] {prompt}"
    assert sample_main([*args, "--prompt", "hi", "--chat", "--logprobs"]) == 0
    assert len(capsys.readouterr().out.splitlines()) >= 5
    assert cli_main(["sample", *args, "--prompt", "word " * 80]) == 2
    assert "server's context is 64 tokens" in capsys.readouterr().err
    assert cli_main(["sample", *args, "--prompt", "x", "--speculative-tokens", "1", "--draft-experts", "5"]) == 2
    assert "draft experts=5 must be in 0..model.num_experts_per_tok=2" in capsys.readouterr().err
    long = ["--checkpoint", str(ckpts[0]), "--max-len", "510", "--prompt", "x", "--speculative-tokens", "2"]
    assert cli_main(["sample", *long]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings=512 less 2 x --speculative-tokens 2; accepted: at most 508" in err


# ---------------------------------------------------------------------------- checkpoint kinds
def test_hf_and_converted_directories_load_the_same_weights(ckpts, served, tmp_path, capsys):
    from composer_jax.hf.checkpoint_kind import detect
    from composer_jax.hf.convert import main as convert_main
    from composer_jax.hf.weights import save_pretrained

    policy = served["policy"]
    hf_dir = save_pretrained(policy.params, policy.cfg, tmp_path / "hf")
    assert convert_main(["--from-hf", str(hf_dir), "--to-orbax", str(tmp_path / "orbax")]) == 0
    capsys.readouterr()
    assert [detect(p).kind for p in (ckpts[0], ckpts[0] / "1", hf_dir, tmp_path / "orbax")] == [
        "run",
        "run",
        "hf",
        "orbax",
    ]
    want = dict(jax.tree_util.tree_leaves_with_path(policy.params))
    for where in (hf_dir, tmp_path / "orbax"):
        loaded = load_policy(where)
        assert loaded.tokenizer_hint is None  # these directories hold no tokenizer: serve needs --tokenizer
        for path, leaf in jax.tree_util.tree_leaves_with_path(loaded.params):
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[path]), err_msg=f"{where} {path}")
    with pytest.raises(ConfigError, match="none of the three kinds of checkpoint .*; accepted"):
        detect(tmp_path)


def test_serve_cli_refuses_bad_settings(ckpts, tmp_path, capsys):
    from composer_jax.inference.server.cli import serve_main

    assert cli_main(["serve", "--checkpoint", str(ckpts[0]), "--api-key", "short"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    assert cli_main(["serve", "--checkpoint", str(tmp_path), "--api-key", KEY]) == 2
    assert f"--checkpoint={str(tmp_path)!r}: none of the three kinds of checkpoint" in capsys.readouterr().err
    assert cli_main(["serve", "--checkpoint", str(ckpts[0]), "--api-key", KEY, "--max-len", "9999"]) == 2
    assert "exceeds the model's max_position_embeddings=512" in capsys.readouterr().err
    assert cli_main(["serve", "--checkpoint", str(ckpts[0]), "--api-key", KEY, "--step", "7"]) == 2
    assert "saved steps: [1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--checkpoint", str(ckpts[0]), "--api-key", KEY, "--prefix-cache", "on"])
    err = capsys.readouterr().err
    assert "--prefix-cache: invalid choice: 'on'" in err and all(m in err for m in ("none", "version", "keep"))


def test_serve_warm_up_compiles_the_admission_programs(ckpts):
    policy = load_policy(ckpts[0])
    tok = load_tokenizer(policy.tokenizer_hint)
    _, engine = build_server(
        policy,
        tok,
        sampler=SamplerConfig(slots=2, max_queued=1, warm_up=True),
        max_len=32,
        api_key=KEY,
        model_name="tiny-test",
    )
    try:  # groups 1, 2 x buckets 16, 32, traced before any request
        assert engine.sampler.compilations == 4 and engine.sampler.warm_up_s > 0 and engine.steps == 0
    finally:
        engine.stop()


def test_a_failed_swap_answers_by_what_failed():
    """Both weight-loading routes (checkpoint and weight store) answer a swap that did not happen
    the same way: 503 once the engine stopped, 500 naming what failed, a route's own ApiError as is."""
    from composer_jax.inference.engine.thread_engine import EngineStopped
    from composer_jax.inference.server.app import _swap_errors
    from composer_jax.inference.server.openai_api import ApiError

    def answer(exc: Exception) -> ApiError:
        with pytest.raises(ApiError) as got:
            with _swap_errors("version 5 of 'file://s' failed in its first decode step", 4):
                raise exc
        return got.value

    e = answer(RuntimeError("boom"))
    assert (e.status, e.code) == (500, "engine_error")
    assert e.message == (
        "version 5 of 'file://s' failed in its first decode step (RuntimeError: boom); version 4 is back in place"
    )
    e = answer(EngineStopped("the engine was stopped"))
    assert (e.status, e.code, e.message) == (503, "shutting_down", "the engine was stopped")
    own = ApiError(400, "weight store 'x': bad", code="bad_weight_store")
    assert answer(own) is own

"""A live `composer-jax serve` app (engine + OpenAI server) in a thread of this process, on the tiny
model the sampler tests share: the serve row of the sampler tests (test_remote_policy.py,
test_sampler_contract.py); `app_in_thread` serves any app so (the server tests)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

import composer_jax as cj
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
from composer_jax.inference.engine.thread_engine import Engine
from composer_jax.inference.server.app import OpenAIServer
from support.live_env import REPO

TOK = load_tokenizer(REPO / "assets" / "tokenizer")
CFG = cj.ModelConfig(num_layers=2, num_mtp_layers=0, vocab_size=TOK.vocab_size, max_position_embeddings=256)
KEY = "remote-policy-key-0123456789"
MAX_LEN = 192


def serve_in_thread(params, version: int = 3):
    engine = Engine(
        lambda p, v: Sampler(p, CFG, SamplerSettings(slots=2, max_len=MAX_LEN), version=v),
        params,
        version,
        max_queued=4,
    )
    engine.start()
    server = OpenAIServer(engine, TOK, model_name="tiny", api_key=KEY)
    url, http, thread = app_in_thread(server.app)
    return url, engine, http, thread


def app_in_thread(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Serve an ASGI app on a free 127.0.0.1 port in a daemon thread; returns once /health answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):
        try:
            httpx.get(url + "/health", timeout=1.0)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    return url, http, thread


def stop_app(http: uvicorn.Server, thread: threading.Thread) -> None:
    http.should_exit = True
    thread.join(10)

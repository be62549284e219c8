"""What `serve`'s /metrics reads from the engine, below the HTTP layer: the driver's time to first
token (once per request, after the step that prefilled it; a request cancelled while waiting never
counts), its generated-token, weight-swap and prefill-seconds totals (kept across a sampler rebuilt
after a failed step), the scrape-time collector over an engine (read back with prometheus_client's parser), and the
request wrapper's counts of an unhandled error (a 500) and of unknown paths ("other").
The live server's scrape test is in test_server.py (its served fixture)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import jax
import numpy as np
from support.metrics_scrape import parse

import composer_jax as cj
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.driver import Driver, Event, Job, Swap
from composer_jax.inference.engine.thread_engine import Engine
from composer_jax.inference.engine.token_sampling import SamplingParams
from composer_jax.inference.server import metrics as serve_metrics
from composer_jax.inference.server.metrics import ServeMetrics

CFG = cj.ModelConfig(num_layers=1, first_k_dense=0, num_mtp_layers=0, max_position_embeddings=32)


def _job(rid: str, max_tokens: int, listener, stream: bool = False) -> Job:
    prompt = [int(t) for t in np.random.default_rng(len(rid)).integers(0, CFG.vocab_size, 5)]
    return Job(Request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), id=rid), listener, stream)


def _sampler(params, version):
    return Sampler(params, CFG, SamplerSettings(slots=2, max_len=16), version=version)


def test_driver_times_first_tokens_and_keeps_totals_across_a_rebuild() -> None:
    params = cj.init_params(CFG, jax.random.key(0))
    driver = Driver(_sampler, params, 0)
    told: list[tuple[int, float]] = []  # (steps run when told, seconds)
    driver.first_token = lambda s: told.append((driver.steps, s))
    seen: dict[str, int] = {}  # the oracle: the step after which each request's first tokens were streamed
    events: list[Event] = []

    def listen(ev: Event) -> None:
        events.append(ev)
        seen.setdefault(ev.request_id, driver.steps)

    jobs = [_job(rid, n, listen, stream=True) for rid, n in (("a", 4), ("bb", 2), ("ccc", 2), ("dddd", 2))]
    driver.cycle(jobs, [], [])  # two slots: a and b are admitted, c and d wait
    assert driver.sampler.waiting == 2 and len(told) == 2
    driver.cycle([], ["dddd"], [])  # d is cancelled while it waits: it never has a first token
    while driver.busy:
        driver.cycle([], [], [])
    assert sorted(seen) == ["a", "bb", "ccc"] and seen["ccc"] > 1
    assert [n for n, _ in told] == sorted(seen.values())
    assert all(s > 0 for _, s in told) and told[2][1] > told[0][1]  # c waited for a slot
    done = [e.completion for e in events if e.completion is not None]
    assert driver.tokens_generated == sum(len(c.tokens) for c in done) == 8
    # weights the decode program cannot take: the step fails, the sampler is rebuilt, totals stay
    swap = Swap(jax.tree.map(lambda x: x[..., :1], params), 1, concurrent.futures.Future())
    driver.cycle([_job("e", 2, listen)], [], [swap])
    assert driver.failures == 1 and swap.future.exception() is not None
    assert driver.swaps == 1 and driver.tokens_generated == 8 and len(told) == 3  # e failed before a token
    prefill = driver.prefill_s  # the failed sampler's admission seconds stay counted
    assert prefill > 0 and driver.sampler.prefill_s == 0.0
    driver.cycle([_job("ff", 2, listen)], [], [])
    assert driver.tokens_generated == 10 and len(told) == 4
    assert driver.prefill_s == prefill + driver.sampler.prefill_s > prefill


def test_collector_reads_the_engine_at_scrape_time(monkeypatch) -> None:
    params = cj.init_params(CFG, jax.random.key(0))
    engine = Engine(_sampler, params, 3, max_queued=4)
    m = ServeMetrics(engine, model_name="tiny", max_len=16, endpoints=["/v1/completions"])
    first = parse(m.render().decode())
    assert first("cj_serve_model_info", model="tiny", max_len="16", slots="2") == 1
    assert first("cj_serve_slots") == 2 and first("cj_serve_weight_version") == 3
    assert first("cj_serve_generation_tokens_total") == 0
    assert first("cj_serve_recent_generation_tokens_per_second") == 0
    assert first.types["cj_serve_time_to_first_token_seconds"] == "histogram"
    assert m.endpoint("/v1/completions") == "/v1/completions" and m.endpoint("/x/../etc") == "other"
    events: list[Event] = []
    # the engine thread is not started: the test runs its driver's cycles itself
    engine.submit([_job("a", 4, None).request], events.append)
    engine.submit([_job("bb", 4, None).request, _job("ccc", 4, None).request], events.append)
    inbox, engine._inbox = engine._inbox, []
    engine.driver.cycle(inbox, [], [])
    monkeypatch.setattr(serve_metrics, "RATE_WINDOW_S", 0.0)
    busy = parse(m.render().decode())
    assert busy("cj_serve_slots_in_use") == 2 and busy("cj_serve_requests_waiting") == 1
    # a step prefills (a first token) and decodes (a second) the two admitted requests
    assert busy("cj_serve_generation_tokens_total") == 4 and busy("cj_serve_prompt_tokens_total") == 10
    assert busy("cj_serve_recent_generation_tokens_per_second") > 0  # 4 tokens since the first scrape
    while engine.driver.busy:
        engine.driver.cycle([], [], [])
    idle = parse(m.render().decode())
    assert idle("cj_serve_slots_in_use") == 0 and idle("cj_serve_requests_waiting") == 0
    assert idle("cj_serve_generation_tokens_total") == 12 and idle("cj_serve_prompt_tokens_total") == 15
    assert idle("cj_serve_engine_steps_total") == engine.steps > 0
    # the admissions' seconds, a part of the steps' (the rest decodes)
    assert 0 < idle("cj_serve_prefill_seconds_total") == engine.prefill_s < idle("cj_serve_engine_step_seconds_total")
    assert 0 < idle("cj_serve_prefill_compile_seconds_total") == engine.prefill_trace_s <= engine.prefill_s


def test_request_wrapper_counts_unhandled_errors_and_unknown_paths() -> None:
    from types import SimpleNamespace

    import pytest

    from composer_jax.inference.server.metrics import ObserveRequests

    stand_in: Any = SimpleNamespace(sampler=SimpleNamespace(slots=1), tokens_generated=0)
    m = ServeMetrics(stand_in, model_name="m", max_len=8, endpoints=["/v1/completions"])

    async def app(scope, receive, send):
        if scope["path"] == "/v1/completions":
            raise RuntimeError("a bug")  # Starlette's outermost layer answers it with a 500
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        pass

    wrapped = ObserveRequests(app, m)

    async def go():
        with pytest.raises(RuntimeError):
            await wrapped({"type": "http", "path": "/v1/completions"}, None, send)
        for i in range(3):
            await wrapped({"type": "http", "path": f"/scan/{i}"}, None, send)

    asyncio.run(go())
    registry = m.registry
    assert registry.get_sample_value("cj_serve_requests_total", {"endpoint": "/v1/completions", "status": "500"}) == 1
    assert registry.get_sample_value("cj_serve_requests_total", {"endpoint": "other", "status": "404"}) == 3
    assert registry.get_sample_value("cj_serve_request_seconds_count", {"endpoint": "other"}) == 3
    assert len(wrapped._series) == 1  # unknown paths are not remembered one by one

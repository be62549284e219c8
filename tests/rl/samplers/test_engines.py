"""The sampler engine registry (rl/samplers/engines.py): which engine a config picks, what each
declares, and that its replica engines are config's `rl.sampler_engine` names."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from composer_jax.config import Config
from composer_jax.config.rl import SAMPLER_ENGINES
from composer_jax.config.vllm import VLLMConfig
from composer_jax.errors import ConfigError
from composer_jax.rl.samplers import engines
from composer_jax.rl.samplers.engines import ENGINES, REPLICA_ENGINES, SamplerStart, engine_of

NCCL = VLLMConfig(weight_update="nccl", nccl_host="10.0.0.1")  # what replicas by URL need


def _cfg(**rl) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, **rl))


def test_replica_engines_are_configs_names():
    assert REPLICA_ENGINES == SAMPLER_ENGINES
    assert set(ENGINES) == {"in-process", *SAMPLER_ENGINES}


@pytest.mark.parametrize(
    ("rl", "name"),
    [
        ({}, "in-process"),
        ({"local_samplers": 2}, "serve"),
        ({"sampler_urls": ("http://h:1",), "weight_store": "file:///s"}, "serve"),
        ({"local_samplers": 1, "sampler_engine": "vllm"}, "vllm"),
        ({"sampler_urls": ("http://h:1",), "sampler_engine": "vllm", "vllm": NCCL}, "vllm"),
    ],
)
def test_engine_of(rl, name):
    assert engine_of(_cfg(**rl)).name == name


def test_engine_of_refuses_an_unknown_engine():
    cfg = _cfg(local_samplers=1)
    object.__setattr__(cfg.rl, "sampler_engine", "sglang")  # past the config's own check
    with pytest.raises(ConfigError, match="rl.sampler_engine='sglang'"):
        engine_of(cfg)


def test_what_each_engine_declares():
    i, s, v = ENGINES["in-process"], ENGINES["serve"], ENGINES["vllm"]
    assert (i.places, i.weight_store, i.needs_store, i.pins_trainer) == ("nothing", "none", False, False)
    assert (s.places, s.weight_store, s.needs_store, s.pins_trainer) == ("serve replicas", "tensorstore", True, True)
    assert (v.places, v.weight_store, v.needs_store, v.pins_trainer) == (
        "vllm replicas",
        "restart-or-nccl",
        False,
        False,
    )


def test_store_url(tmp_path):
    def url(**rl) -> str:
        cfg = _cfg(**rl)
        return engine_of(cfg).store_url(cfg, tmp_path)

    assert url(local_samplers=1) == f"file://{tmp_path.resolve()}/weight_store"  # local serve replicas
    assert url(local_samplers=1, weight_store="gs://b/s") == "gs://b/s"
    assert url() == ""
    assert url(weight_store="file:///s") == "file:///s"  # in-process with a store named: published there
    assert url(sampler_urls=("http://h:1",), weight_store="file:///s") == "file:///s"
    assert url(local_samplers=1, sampler_engine="vllm") == ""
    assert url(sampler_urls=("http://h:1",), sampler_engine="vllm", vllm=NCCL) == ""


def test_checkpoint_first_only_for_local_serve_replicas():
    def first(**rl) -> bool:
        cfg = _cfg(**rl)
        return engine_of(cfg).checkpoint_first(cfg)

    assert first(local_samplers=2)
    assert not first()
    assert not first(sampler_urls=("http://h:1",), weight_store="file:///s")
    assert not first(local_samplers=1, sampler_engine="vllm")


def _start(engine_name: str, **rl):
    cfg = _cfg(**rl)
    made = []

    def make_samplers(c, **kw):
        made.append((c, kw))
        return "backend"

    start = SamplerStart(cfg, make_samplers, {"tok": "T", "version": 3}, "CK", "file:///s", Path("OUT"), print)

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            return await ENGINES[engine_name].start(stack, start)

    return asyncio.run(go()), made


def test_in_process_start_makes_the_samplers():
    (backend, placement), made = _start("in-process")
    assert (backend, placement) == ("backend", None)
    assert made[0][1] == {"tok": "T", "version": 3}


def test_serve_start_is_start_serve(monkeypatch):
    seen = {}

    def start_serve(stack, cfg, tok, **kw):
        seen.update(kw, tok=tok)
        return "replicas", "launcher"

    monkeypatch.setattr(engines, "start_serve", start_serve)
    (backend, placement), made = _start("serve", local_samplers=1)
    assert (backend, placement, made) == ("replicas", "launcher", [])
    assert seen == {
        "tok": "T",
        "version": 3,
        "checkpoint_dir": "CK",
        "store_url": "file:///s",
        "out_dir": Path("OUT"),
        "echo": print,
    }


def test_the_registry_imports_no_vllm_code():
    code = (
        "import sys; import composer_jax.rl.samplers.engines; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' "
        "or m.startswith('composer_jax.rl.samplers.vllm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

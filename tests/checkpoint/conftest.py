"""Session fixtures: each tiny transformers model of hf_cases.CASES built and saved to disk once."""
from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_cases import VOCAB, Built, build_model  # noqa: E402  (tests/checkpoint/hf_cases.py)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """name -> Built(torch model, directory written by transformers' save_pretrained), cached."""
    @functools.lru_cache(maxsize=None)
    def get(name: str) -> Built:
        model = build_model(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        return Built(model, path)
    return get


@pytest.fixture(scope="session")
def tokens():
    return np.random.RandomState(0).randint(0, VOCAB, size=(2, 16)).astype(np.int32)

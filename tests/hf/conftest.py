"""Session fixtures: each tiny transformers model of hf_cases.CASES built and saved to disk once."""

from __future__ import annotations

import functools

import numpy as np
import pytest

# hf_cases (tests/support/hf_cases.py) imports torch/transformers: imported inside the fixtures
# so that the tests here that need neither still run where they are not installed.


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """name -> Built(torch model, directory written by transformers' save_pretrained), cached."""
    from support.hf_cases import Built, build_model

    @functools.cache
    def get(name: str) -> Built:
        model = build_model(name)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        return Built(model, path)

    return get


@pytest.fixture(scope="session")
def tokens():
    from support.hf_cases import VOCAB

    return np.random.RandomState(0).randint(0, VOCAB, size=(2, 16)).astype(np.int32)

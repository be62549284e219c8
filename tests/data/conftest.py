"""Shared fixtures for the data tests: the shipped tokenizer."""

import pytest
from datahelpers import REPO


@pytest.fixture(scope="session")
def tok_dir() -> str:
    return str(REPO / "assets" / "tokenizer")


@pytest.fixture(scope="session")
def tok(tok_dir):
    from composer_jax.formats.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)

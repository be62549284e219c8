"""Data pipelines on grain: sources, tokenizer, packing, mixtures, chat/SFT formatting (docs/data.md).

Public entry points (imported lazily so that `composer_jax.config.data` stays light):
`make_train_iterator`, `make_eval_batches`, `load_tokenizer`, `DataConfig`, `SourceConfig`.
"""

from __future__ import annotations

from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig

__all__ = [
    "DataConfig",
    "DataConfigError",
    "SourceConfig",
    "load_tokenizer",
    "make_eval_batches",
    "make_train_iterator",
    "render_chat",
]


def __getattr__(name: str):
    if name in ("make_train_iterator", "make_eval_batches"):
        from composer_jax.data import pipeline

        return getattr(pipeline, name)
    if name == "load_tokenizer":
        from composer_jax.formats.tokenizer import load_tokenizer

        return load_tokenizer
    if name == "render_chat":
        from composer_jax.formats.chatml import render_chat

        return render_chat
    raise AttributeError(f"module 'composer_jax.data' has no attribute {name!r}")

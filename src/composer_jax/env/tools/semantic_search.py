"""Ranked code search over a workspace: BM25 over line-window chunks, or embeddings when available.

Chunks are windows of CHUNK_LINES lines overlapping by CHUNK_OVERLAP, so a hit carries enough
context to act on. Tokens are identifiers split the way programmers write them: `parseHTTPHeader`
and `parse_http_header` both give `parse`, `http`, `header` (plus the whole identifier), so a
natural-language query finds code.

BM25 (Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and Beyond", 2009):
    score(q, d) = sum_t idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))
with k1 = 1.2, b = 0.75.

An embedding ranking is used instead only when a sentence-embedding model is installed locally
(the `sentence_transformers` package and a model directory named by COMPOSER_JAX_EMBEDDING_MODEL);
the response always says which ranking produced it.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass

from composer_jax.env.api import protocol

CHUNK_LINES = 40
CHUNK_OVERLAP = 10
K1, B = 1.2, 0.75

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


def tokenize(text: str) -> list[str]:
    """Lower-cased identifier tokens and their camelCase / snake_case parts."""
    out = []
    for ident in _IDENT.findall(text):
        low = ident.lower()
        out.append(low)
        pieces = [p.lower() for part in ident.split("_") if part for p in _CAMEL.findall(part)]
        if len(pieces) > 1 or (pieces and pieces[0] != low):
            out.extend(pieces)
    return out


@dataclass
class Chunk:
    path: str
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str


def chunk_file(path: str, text: str) -> list[Chunk]:
    lines = text.splitlines()
    if not lines:
        return []
    chunks, step = [], CHUNK_LINES - CHUNK_OVERLAP
    for start in range(0, len(lines), step):
        window = lines[start : start + CHUNK_LINES]
        chunks.append(Chunk(path, start + 1, start + len(window), "\n".join(window)))
        if start + CHUNK_LINES >= len(lines):
            break
    return chunks


def bm25_rank(query: str, chunks: list[Chunk], top_k: int) -> list[tuple[float, Chunk]]:
    """The `top_k` chunks by BM25 score (score > 0 only), best first."""
    q_terms = set(tokenize(query))
    if not q_terms or not chunks:
        return []
    docs = [Counter(tokenize(c.text + " " + c.path)) for c in chunks]
    lengths = [sum(d.values()) for d in docs]
    avgdl = (sum(lengths) / len(lengths)) or 1.0
    n = len(docs)
    df = {t: sum(1 for d in docs if t in d) for t in q_terms}
    idf = {t: math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in q_terms}
    scored = []
    for doc, length, chunk in zip(docs, lengths, chunks):
        s = 0.0
        for t in q_terms:
            tf = doc.get(t, 0)
            if tf:
                s += idf[t] * tf * (K1 + 1) / (tf + K1 * (1 - B + B * length / avgdl))
        if s > 0:
            scored.append((s, chunk))
    scored.sort(key=lambda x: (-x[0], x[1].path, x[1].start_line))
    return scored[:top_k]


_embedder = None


def _embedding_model():
    """A locally installed sentence-embedding model, or None (never downloads anything)."""
    global _embedder
    if _embedder is None:
        _embedder = False
        model_dir = os.environ.get("COMPOSER_JAX_EMBEDDING_MODEL")
        if model_dir and os.path.isdir(model_dir):
            try:
                from sentence_transformers import SentenceTransformer  # optional dependency

                _embedder = SentenceTransformer(model_dir, device="cpu")
            except Exception:  # noqa: BLE001 - any failure means "not installed": fall back to BM25
                _embedder = False
    return _embedder or None


def search(query: str, files: list[tuple[str, str]], top_k: int = 10) -> dict:
    """Rank chunks of `files` ((path, text) pairs) for `query`; says which ranking was used."""
    chunks = [c for path, text in files for c in chunk_file(path, text)]
    model = _embedding_model()
    if model is not None and chunks:
        import numpy as np

        vecs = model.encode([c.text for c in chunks] + [query], normalize_embeddings=True)
        sims = vecs[:-1] @ vecs[-1]
        order = np.argsort(-sims)[:top_k]
        ranked = [(float(sims[i]), chunks[i]) for i in order]
        ranking = f"embedding ({os.path.basename(os.environ['COMPOSER_JAX_EMBEDDING_MODEL'])})"
    else:
        ranked = bm25_rank(query, chunks, top_k)
        ranking = "bm25"
    return protocol.semantic_search_result(
        ranking, len(chunks), [protocol.search_hit(c.path, c.start_line, c.end_line, s, c.text) for s, c in ranked]
    )

"""An offline documentation index: BM25 over the installed packages' docstrings and a directory of pages.

The default backend of the `web_search` tool (`env/tools/web_search.py`), so the tool works with no
network. Documents:

* one per module, class and public function or method of every installed distribution indexed
  (`--docs-packages`; default all of the server's environment; their `tests`/`test` packages left
  out), read from the *source* with `ast`:
  the qualified name, the signature and the docstring. Packages are never imported (importing runs
  their code, and some import JAX or start threads); a file that does not parse is skipped. Its
  URL is `pydoc://MODULE.QUALNAME`, which the page reader resolves to the definition's source.
* one per page of `--docs-dir DIR` (.html, .htm, .md, .rst, .txt; HTML through `env/tools/html_text.py`),
  URL `docs://RELATIVE/PATH`.

Ranking is BM25 (k1 = 1.2, b = 0.75, as `env/tools/semantic_search.py`) over identifier-aware tokens
(`semantic_search.tokenize`) reduced by a crude stemmer (suffixes off, then the first 6 letters),
so "approximately" meets `approx` and "comparing" meets "compare". A definition's own name counts
NAME_WEIGHT times: a query naming what it wants ranks the definition above text that mentions it.

The built index is cached on disk (a gzipped JSON file named by a digest of the indexed
distributions' names and versions, the docs directory's files and sizes and mtimes, and
INDEX_VERSION), so a restarted server reuses it; `DocIndex.ensure()` builds or loads it once,
thread-safely, and the server calls it off the event loop.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import math
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from composer_jax.env.tools.html_text import html_to_text
from composer_jax.env.tools.semantic_search import tokenize

INDEX_VERSION = 2
K1, B = 1.2, 0.75
NAME_WEIGHT = 3
MAX_DOC_TEXT = 4000  # characters of a docstring or page kept for snippets and ranking
MAX_SOURCE_BYTES = 2 * 2**20  # larger .py files (generated tables) are skipped
PAGE_SUFFIXES = (".html", ".htm", ".md", ".rst", ".txt")
_SUFFIXES = ("ations", "ation", "ately", "ingly", "ally", "ness", "ment", "ing", "ies", "ed", "ly", "es", "s", "e")


def stem(token: str) -> str:
    for suffix in _SUFFIXES:
        if len(token) > len(suffix) + 2 and token.endswith(suffix):
            token = token[: -len(suffix)]
            break
    return token[:6]


def terms(text: str) -> list[str]:
    return [stem(t) for t in tokenize(text)]


@dataclass
class Doc:
    title: str
    url: str
    text: str  # docstring or page text (cut to MAX_DOC_TEXT)
    source: str = ""  # file the page reader opens
    lines: tuple[int, int] = (0, 0)  # the definition's lines in `source` (0, 0: the whole file)
    package: str = ""  # distribution name and version, or "docs"


@dataclass
class _Postings:
    docs: list[Doc] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    postings: dict[str, list] = field(default_factory=dict)  # term -> [(doc, tf), ...] (lists once loaded)

    def add(self, doc: Doc, name: str) -> None:
        counts = Counter(terms(doc.text + " " + doc.title))
        for t in terms(name):
            counts[t] += NAME_WEIGHT
        i = len(self.docs)
        self.docs.append(doc)
        self.lengths.append(sum(counts.values()))
        for t, tf in counts.items():
            self.postings.setdefault(t, []).append((i, tf))


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return f"({ast.unparse(node.args)})"
    except (ValueError, RecursionError):  # an odd node ast cannot write back
        return "(...)"


def _definitions(tree: ast.Module, module: str) -> Iterator[tuple[str, str, str, int, int]]:
    """(name, title, docstring, first line, last line) for the module, its public classes and
    functions, and their public methods (those with a docstring, or any public class/function)."""
    yield module, module, ast.get_docstring(tree) or "", 0, 0

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, str, str, int, int]]:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            qual = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node) or ""
            if node.name == "__init__" and not doc:
                continue
            if isinstance(node, ast.ClassDef):
                yield qual, f"class {qual}", doc, node.lineno, node.end_lineno or node.lineno
                yield from walk(node.body, qual)
            else:
                yield qual, qual + _signature(node), doc, node.lineno, node.end_lineno or node.lineno

    yield from walk(tree.body, module)


def _module_name(rel: str) -> str | None:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or not all(p.isidentifier() for p in parts):
        return None  # scripts with dashes, *.dist-info: not importable modules
    if any(p in ("tests", "test") for p in parts):
        return None  # a package's own test suite: many definitions, no API to look up
    return ".".join(parts)


def _distribution_sources(dist: metadata.Distribution) -> Iterator[tuple[str, Path]]:
    seen = set()
    for f in dist.files or ():
        rel = str(f).replace(os.sep, "/")
        if not rel.endswith(".py") or "__pycache__" in rel or rel.startswith(".."):
            continue
        module = _module_name(rel)
        if module and module not in seen:
            seen.add(module)
            yield module, Path(str(dist.locate_file(f)))


def select_distributions(
    names: Iterable[str] | None = None, path: list[str] | None = None
) -> list[metadata.Distribution]:
    """The installed distributions to index: all of them, or those named (case and -/_ ignored),
    from `path` (default sys.path). A name not installed raises ValueError naming it and what is."""
    by_name: dict[str, metadata.Distribution] = {}
    found = metadata.distributions() if path is None else metadata.distributions(path=path)
    for dist in found:
        name = dist.metadata["Name"]
        if name:
            by_name.setdefault(_norm(name), dist)
    if names is None:
        return [by_name[k] for k in sorted(by_name)]
    wanted = [_norm(n) for n in names]
    missing = [n for n, w in zip(names, wanted) if w not in by_name]
    if missing:
        raise ValueError(
            f"not installed in this environment: {', '.join(missing)}; installed: {', '.join(sorted(by_name))}"
        )
    return [by_name[w] for w in dict.fromkeys(wanted)]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _page_docs(root: Path) -> Iterator[Doc]:
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix.lower() not in PAGE_SUFFIXES:
            continue
        rel = path.relative_to(root).as_posix()
        raw = path.read_text("utf-8", "replace")
        if path.suffix.lower() in (".html", ".htm"):
            title, text = html_to_text(raw)
        else:
            text = raw
            first = next((line.strip("#= \t") for line in raw.splitlines() if line.strip("#=-~ \t")), "")
            title = first[:120]
        yield Doc(title or rel, f"docs://{rel}", text[:MAX_DOC_TEXT], str(path), (0, 0), "docs")


class DocIndex:
    """The offline index over `packages` (installed distribution names; None = all) and `docs_dir`;
    `search_path` is where distributions are looked for (default sys.path)."""

    def __init__(
        self,
        packages: list[str] | None = None,
        docs_dir: Path | None = None,
        cache_dir: Path | None = None,
        search_path: list[str] | None = None,
    ):
        self.dists = select_distributions(packages, search_path)
        self.docs_dir = docs_dir
        if docs_dir is not None and not docs_dir.is_dir():
            raise ValueError(f"--docs-dir {docs_dir} is not a directory")
        self.cache_dir = cache_dir
        self._lock = threading.Lock()
        self._index: _Postings | None = None
        self._norm: list[float] = []
        self.build_s: float | None = None
        self.from_cache = False

    def key(self) -> str:
        """The cache key: what was indexed (distributions and versions, the docs directory's files)."""
        h = hashlib.sha256(f"v{INDEX_VERSION}".encode())
        for d in self.dists:
            h.update(f"\0{d.metadata['Name']}=={d.version}".encode())
        if self.docs_dir is not None:
            h.update(f"\0docs:{self.docs_dir.resolve()}".encode())
            for p in sorted(self.docs_dir.rglob("*")):
                if p.is_file() and p.suffix.lower() in PAGE_SUFFIXES:
                    st = p.stat()
                    h.update(f"\0{p.relative_to(self.docs_dir)}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()[:24]

    def _build(self) -> _Postings:
        idx = _Postings()
        for dist in self.dists:
            package = f"{dist.metadata['Name']} {dist.version}"
            for module, path in _distribution_sources(dist):
                try:
                    if path.stat().st_size > MAX_SOURCE_BYTES:
                        continue
                    tree = ast.parse(path.read_bytes(), str(path))
                except (OSError, SyntaxError, ValueError, RecursionError):
                    continue
                for name, title, doc, lo, hi in _definitions(tree, module):
                    idx.add(Doc(title, f"pydoc://{name}", doc[:MAX_DOC_TEXT], str(path), (lo, hi), package), name)
        if self.docs_dir is not None:
            for page in _page_docs(self.docs_dir):
                idx.add(page, page.title)
        return idx

    def ensure(self) -> None:
        """Load the index from the cache or build it (and cache it); once, whoever calls first."""
        with self._lock:
            if self._index is not None:
                return
            start = time.monotonic()
            path = self.cache_dir / f"doc-index-{self.key()}.json.gz" if self.cache_dir else None
            idx = _load(path) if path is not None and path.exists() else None
            self.from_cache = idx is not None
            if idx is None:
                idx = self._build()
                if path is not None:
                    _save(path, idx)
            avgdl = (sum(idx.lengths) / len(idx.lengths)) if idx.lengths else 1.0
            # BM25's length normalisation per document, once: a query touches every posting of its terms
            self._norm = [K1 * (1 - B + B * n / avgdl) for n in idx.lengths]
            self._index = idx
            self.build_s = time.monotonic() - start

    def __len__(self) -> int:
        self.ensure()
        assert self._index is not None
        return len(self._index.docs)

    def search(self, query: str, k: int = 5) -> list[tuple[float, Doc]]:
        """The `k` best documents for `query` by BM25, best first (score > 0 only)."""
        self.ensure()
        idx = self._index
        assert idx is not None
        n, norms = len(idx.docs), self._norm
        scores: dict[int, float] = {}
        get = scores.get
        for t in set(terms(query)):
            plist = idx.postings.get(t)
            if not plist:
                continue
            idf = math.log(1 + (n - len(plist) + 0.5) / (len(plist) + 0.5)) * (K1 + 1)
            for i, tf in plist:
                scores[i] = get(i, 0.0) + idf * tf / (tf + norms[i])
        best = sorted(scores.items(), key=lambda x: (-x[1], idx.docs[x[0]].url))[:k]
        return [(s, idx.docs[i]) for i, s in best]

    def get(self, url: str) -> Doc | None:
        self.ensure()
        assert self._index is not None
        return next((d for d in self._index.docs if d.url == url), None)


def _save(path: Path, idx: _Postings) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "docs": [[d.title, d.url, d.text, d.source, list(d.lines), d.package] for d in idx.docs],
        "lengths": idx.lengths,
        "postings": idx.postings,
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=3) as f:
        json.dump(body, f, separators=(",", ":"))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one


def _load(path: Path) -> _Postings | None:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            body = json.load(f)
        docs = [Doc(t, u, x, s, (a, b), p) for t, u, x, s, (a, b), p in body["docs"]]
        # the postings stay as JSON decoded them ([doc, tf] lists): converting ~10^7 pairs to tuples
        # took as long as reading the file
        return _Postings(docs, body["lengths"], body["postings"])
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None  # a damaged or foreign cache file: rebuild

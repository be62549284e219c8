"""Where the bundled data lives: the stage configs, the tokenizer and SFT sets, the coding tasks.

In a checkout they are the repository's `configs/`, `assets/`, `tasks/` and `docs/`. A built wheel
carries copies of them inside the package, under `composer_jax/_data/` (setup.py's build step puts
them there), so an installed `composer-jax` finds them from any directory. `data_root()` is the
folder holding them in either layout; `data_path("configs", "rl", "tiny_disable_debug.yaml")` one
file in it. The packaged copy wins when both exist.

The stage-1 corpus of the tiny stages is this project's own code: `code_root()` is `src/` in a
checkout and the installed package's folder otherwise (its `_data/` excluded: `CODE_EXCLUDE`).

Stdlib only: the demo and the entry points use it, and it must import nothing of the rest.
"""

from __future__ import annotations

from pathlib import Path

# what the wheel carries (setup.py copies these folders; tests/test_packaging.py checks the list)
KINDS = ("configs", "assets", "tasks", "docs")
PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGED = PACKAGE_DIR / "_data"
CHECKOUT = PACKAGE_DIR.parents[1]  # src/composer_jax -> the repository root
CODE_EXCLUDE = ("_data/**",)


class DataNotFoundError(FileNotFoundError):
    """The bundled data is neither packaged beside the code nor in a checkout around it."""


def is_packaged() -> bool:
    """True when the code runs from an installed wheel carrying its data."""
    return (PACKAGED / "configs").is_dir()


def _is_checkout(root: Path) -> bool:
    return (root / "configs").is_dir() and (root / "pyproject.toml").is_file() and (root / "src").is_dir()


def data_root() -> Path:
    """The folder holding configs/, assets/, tasks/ and docs/ (packaged copy first, then the checkout)."""
    if is_packaged():
        return PACKAGED
    if _is_checkout(CHECKOUT):
        return CHECKOUT
    raise DataNotFoundError(
        f"no bundled data: neither {PACKAGED} (an installed wheel's copy) nor a checkout at {CHECKOUT} "
        "holds configs/; install a built wheel (pip install composer-jax) or run from a clone of the repository"
    )


def data_path(kind: str, *parts: str) -> Path:
    """A path inside one of the bundled folders, e.g. data_path("tasks") or data_path("configs", "model",
    "tiny.yaml"); kind is one of KINDS. The path is not checked for existence past the folder."""
    if kind not in KINDS:
        raise ValueError(f"bundled data kind {kind!r} is not accepted; accepted: {', '.join(KINDS)}")
    folder = data_root() / kind
    if not folder.is_dir():
        raise DataNotFoundError(f"bundled data folder {folder} does not exist")
    return folder.joinpath(*parts)


def code_root() -> Path:
    """The project's own Python code as a corpus folder: `src/` in a checkout, else the installed package
    (whose `_data/` a directory source should exclude: CODE_EXCLUDE)."""
    return PACKAGE_DIR if is_packaged() else CHECKOUT / "src"

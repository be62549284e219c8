"""The build step that pyproject.toml cannot say: a wheel carries the repository's bundled data.

configs/, assets/, tasks/ and docs/*.md live at the repository root (where a checkout reads them);
a built wheel gets copies under composer_jax/_data/ so that an installed `composer-jax demo` and
`composer-jax env-server --tasks ...` find them from any directory (src/composer_jax/resources.py
looks there first). Everything else about the package is in pyproject.toml. An editable install
reads the checkout itself and copies nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# folder -> file patterns copied (recursively) into composer_jax/_data/<folder>
BUNDLED = {"configs": ("*.yaml",), "assets": ("*",), "tasks": ("*",), "docs": ("*.md",)}
SKIPPED = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "composer_jax" / "_data"
        shutil.rmtree(target, ignore_errors=True)
        for folder, patterns in BUNDLED.items():
            src = ROOT / folder
            if not src.is_dir():
                raise FileNotFoundError(f"bundled data folder {src} is missing: a wheel needs {', '.join(BUNDLED)}")
            for pattern in patterns:
                for f in sorted(src.rglob(pattern)):
                    rel = f.relative_to(ROOT)
                    if not f.is_file() or any(p in SKIPPED or p.endswith(".pyc") for p in rel.parts):
                        continue
                    dest = target / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dest)


setup(cmdclass={"build_py": BuildPyWithData})

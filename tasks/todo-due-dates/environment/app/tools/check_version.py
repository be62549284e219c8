"""Fail unless pyproject's version matches todo.__version__."""
import re
import sys

sys.path.insert(0, ".")
import todo  # noqa: E402

text = open("pyproject.toml", encoding="utf-8").read()
version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
if version != todo.__version__:
    sys.exit(f"version mismatch: pyproject {version} != todo.__version__ {todo.__version__}")
print(f"version {version} ok")

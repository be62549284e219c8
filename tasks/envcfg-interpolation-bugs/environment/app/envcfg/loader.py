"""load(path, env=os.environ): read 'key = value' lines in [sections]; later files override earlier ones."""
import os

from .settings import Settings


def parse_text(text):
    data, section = {}, "main"
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            continue
        if "=" not in line:
            raise ValueError(f"line {lineno}: expected key = value")
        key, value = line.split("=", 1)
        data[f"{section}.{key.strip()}"] = value.strip()
    return data


def load(*paths, env=None):
    env = os.environ if env is None else env
    data = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            data.update(parse_text(fh.read()))
    return Settings(data, env)

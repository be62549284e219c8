import json
import os

from .models import Task


def load(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [Task(**d) for d in json.load(fh)]


def save(path, tasks):
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([t.__dict__ for t in tasks], fh, indent=1)

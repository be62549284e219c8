"""Store: append-only log of JSON lines {"k": key, "v": value} ({"k": key, "d": true} deletes)."""
import json
import os


class Store:
    def __init__(self, path):
        self.path = path
        self._data = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if rec.get("d"):
                        self._data.pop(rec["k"], None)
                    else:
                        self._data[rec["k"]] = rec["v"]

    def _append(self, rec):
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")

    def set(self, key, value):
        self._data[key] = value
        self._append({"k": key, "v": value})

    def get(self, key, default=None):
        return self._data.get(key, default)

    def delete(self, key):
        if key in self._data:
            del self._data[key]
            self._append({"k": key, "d": True})
            return True
        return False

    def keys(self, prefix=""):
        return sorted(k for k in self._data if k.startswith(prefix))

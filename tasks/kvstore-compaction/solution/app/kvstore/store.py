"""Store: append-only log of JSON lines {"k": key, "v": value} ({"k": key, "d": true} deletes)."""
import json
import os
import tempfile


class Store:
    def __init__(self, path, compact_threshold=1000):
        self.path = path
        self._data = {}
        self._records = 0
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    self._records += 1
                    rec = json.loads(line)
                    if rec.get("d"):
                        self._data.pop(rec["k"], None)
                    else:
                        self._data[rec["k"]] = rec["v"]
        if compact_threshold is not None and self._records - len(self._data) > compact_threshold:
            self.compact()

    def compact(self):
        """Rewrite the log with one record per live key (atomically); return how many records were dropped."""
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".compact-", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                for key in sorted(self._data):
                    fh.write(json.dumps({"k": key, "v": self._data[key]}, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dropped = self._records - len(self._data)
        self._records = len(self._data)
        return dropped

    def _append(self, rec):
        self._records += 1
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

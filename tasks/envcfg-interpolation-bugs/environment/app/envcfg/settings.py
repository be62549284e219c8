"""Settings: typed access to interpolated values. Lookup order for ${X}: keys in the file, then env."""
from .interpolate import interpolate

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Settings:
    def __init__(self, data, env):
        self._data, self._env = dict(data), env

    def _lookup(self, name):
        if name in self._data:
            return self._data[name]
        return self._env.get(name)

    def get(self, key, default=None):
        if key not in self._data:
            return default
        return interpolate(self._data[key], self._lookup)

    def get_int(self, key, default=None):
        value = self.get(key)
        return default if value is None else int(value)

    def get_bool(self, key, default=None):
        value = self.get(key)
        if value is None:
            return default
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"{key}: not a boolean: {value!r}")

    def section(self, name):
        prefix = name + "."
        return {k[len(prefix):]: self.get(k) for k in sorted(self._data) if k.startswith(prefix)}

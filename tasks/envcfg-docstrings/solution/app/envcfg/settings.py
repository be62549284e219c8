"""Settings: typed access to interpolated values. Lookup order for ${X}: keys in the file, then env."""
from .interpolate import interpolate

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Settings:
    def __init__(self, data, env):
        """Create settings over raw values.

        Args:
            data: mapping of "section.key" to raw (uninterpolated) strings.
            env: mapping used for references not found in data.

        Returns:
            None.

        Raises:
            Nothing.
        """
        self._data, self._env = dict(data), env

    def _lookup(self, name):
        if name in self._data:
            return self._data[name]
        return self._env.get(name)

    def get(self, key, default=None):
        """Return the interpolated value of key.

        Args:
            key: "section.key" name.
            default: returned when key is not defined.

        Returns:
            The interpolated string, or default.

        Raises:
            InterpolationError: from interpolation of an undefined reference or a cycle.
        """
        if key not in self._data:
            return default
        return interpolate(self._data[key], self._lookup)

    def get_int(self, key, default=None):
        """Return the value of key as an int.

        Args:
            key: "section.key" name.
            default: returned when key is not defined.

        Returns:
            int, or default.

        Raises:
            ValueError: (from int()) when the value is not an integer.
        """
        value = self.get(key)
        return default if value is None else int(value)

    def get_bool(self, key, default=None):
        """Return the value of key as a bool (1/true/yes/on or 0/false/no/off, any case).

        Args:
            key: "section.key" name.
            default: returned when key is not defined.

        Returns:
            bool, or default.

        Raises:
            ValueError: when the value is not a recognised boolean.
        """
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
        """Return all interpolated values of one section.

        Args:
            name: the section name.

        Returns:
            dict of key (without the section prefix) to value, sorted by key.

        Raises:
            Nothing.
        """
        prefix = name + "."
        return {k[len(prefix):]: self.get(k) for k in sorted(self._data) if k.startswith(prefix)}

"""Error types shared by the configuration sections (no imports, so any section may use them)."""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible in combination."""

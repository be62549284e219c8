"""Error types shared across the layers (no imports, so any section, and the environment service,
may use them)."""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible in combination."""


class UsageError(Exception):
    """Something given on a command line (a flag, a path, a value) cannot be used; the message names
    it and what would be accepted. A subcommand raises it where it finds the fault; `composer-jax`
    (composer_jax/cli.py) alone turns it into `composer-jax COMMAND: error: MESSAGE` on stderr and
    exit code 2, as argparse does for a malformed flag."""

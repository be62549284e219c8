"""Error types shared across the layers (no imports, so any section, and the environment service,
may use them)."""


class UserError(Exception):
    """The user's fault, not a bug: something they gave or named (a config value, a checkpoint, a
    safetensors file, a tasks directory) cannot be used, and the message names it and what would be
    accepted. A type is one of these where it is defined (`class XError(UserError, ValueError)`) or
    the fault is wrapped into one where it is checked. `pretrain`, `sft`, `rl` and `eval` turn
    exactly these into a `UsageError` (exit 2, no traceback); any other exception is a bug and
    keeps its traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value is unknown, of the wrong type, or impossible in combination."""


class UsageError(Exception):
    """Something given on a command line (a flag, a path, a value) cannot be used; the message names
    it and what would be accepted. A subcommand raises it where it finds the fault; `composer-jax`
    (composer_jax/cli.py) alone turns it into `composer-jax COMMAND: error: MESSAGE` on stderr and
    exit code 2, as argparse does for a malformed flag. A command that runs a job wraps the job's
    `UserError`s into it."""

"""A command-line fault has one path: the subcommand raises `UsageError` where it finds it, and the
`composer-jax` dispatcher alone prints `composer-jax COMMAND: error: MESSAGE` and exits 2. No
subcommand module prints an error and returns 2 (or None/False as a sentinel) itself.

The second half reads the source (AST), like tests/test_layers.py, so a new subcommand that slips
back into print-and-return-2 fails here whether or not a test drives its error path.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from composer_jax import cli
from composer_jax.checkpoint.validate import CheckpointError, ConfigMismatchError, NoGoodCheckpointError
from composer_jax.errors import UsageError
from composer_jax.hf.safetensors_io import SafetensorsError
from composer_jax.rl.rollout.env_servers import EnvServerError

SRC = Path(__file__).resolve().parents[1] / "src" / "composer_jax"


def _faulty_main(argv: list[str]) -> int:
    raise UsageError(f"--size {argv[0]!r} is not a size; accepted: a positive integer")


def test_a_usage_error_from_any_subcommand_becomes_exit_2_with_its_message(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "faulty", (__name__, "_faulty_main", "raises UsageError"))
    assert cli.main(["faulty", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "composer-jax faulty: error: --size 'x' is not a size; accepted: a positive integer\n"
    assert captured.out == ""


def _broken_main(argv: list[str]) -> int:
    raise RuntimeError("a bug, not a bad flag")


def test_other_exceptions_are_not_turned_into_usage_errors(monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", (__name__, "_broken_main", "raises RuntimeError"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["broken"])


def test_a_real_subcommand_fault_goes_through_the_dispatcher(tmp_path, capsys):
    assert cli.main(["env", "build", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"composer-jax env: error: {tmp_path / 'missing'} is not a directory\n"


REPO = SRC.parents[1]
STAGE1 = str(REPO / "configs" / "pretrain" / "tiny_stage1.yaml")
RL_CONFIG = str(REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml")


def _a_bug(*args, **kwargs):
    raise ValueError("a bug deep inside the run")


@pytest.mark.parametrize(
    "argv, runner, bad_value, message",
    [
        (
            ["pretrain", "--config", STAGE1],
            "composer_jax.train.loop.run_stage",
            "train.micro_batches=3",
            "train.batch_size=8 is not divisible by train.micro_batches=3",
        ),
        (
            ["rl", "--config", RL_CONFIG],
            "composer_jax.rl.learner.run_rl",
            "rl.group_size=1",
            "expected an integer >= 2",
        ),
    ],
)
def test_a_programming_error_keeps_its_traceback_while_a_bad_value_is_exit_2(
    argv, runner, bad_value, message, monkeypatch, capsys, tmp_path
):
    """A ValueError from inside a run is a bug: it propagates (traceback, not exit 2); a bad config
    value (ConfigError, itself a ValueError) is still the user's one-line error and exit 2."""
    monkeypatch.chdir(REPO)
    out = f"train.out_dir={tmp_path}"
    assert cli.main([*argv, out, bad_value]) == 2
    assert message in capsys.readouterr().err
    monkeypatch.setattr(runner, _a_bug)
    with pytest.raises(ValueError, match="a bug deep inside the run"):
        cli.main([*argv, out])


@pytest.mark.parametrize("argv", [["serve", "--api-key", "k" * 16, "--port", "0"], ["sample", "--prompt", "x"]])
def test_serve_and_sample_keep_a_bugs_traceback_while_a_bad_checkpoint_is_exit_2(argv, monkeypatch, capsys, tmp_path):
    """`serve` and `sample` turn only the user's errors into exit 2 (a checkpoint directory of no kind
    here); a ValueError from inside loading is a bug and propagates with its traceback."""
    (tmp_path / "notes.txt").write_text("x")
    args = [*argv, "--checkpoint", str(tmp_path)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"composer-jax {argv[0]}: error: --checkpoint={str(tmp_path)!r}: none of the three kinds" in err
    monkeypatch.setattr("composer_jax.inference.server.policy.load_policy", _a_bug)
    with pytest.raises(ValueError, match="a bug deep inside the run"):
        cli.main(args)


def _a_broken_step(*args, **kwargs):
    def step(*a, **k):
        raise ValueError("a bug in the train step")

    return step


def test_a_value_error_in_the_train_step_is_not_exit_2(monkeypatch, tmp_path):
    """The run gets as far as its first step, whose ValueError (a bug) reaches the caller as it is."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("composer_jax.train.loop.make_train_step", _a_broken_step)
    argv = ["pretrain", "--config", STAGE1, f"train.out_dir={tmp_path}", "train.steps=1", "train.eval_batches=1"]
    with pytest.raises(ValueError, match="a bug in the train step"):
        cli.main(argv)


def _raises(error: BaseException):
    def run(*args, **kwargs):
        raise error

    return run


PRETRAIN = (["pretrain", "--config", STAGE1], "composer_jax.train.loop.run_stage")
RL = (["rl", "--config", RL_CONFIG], "composer_jax.rl.learner.run_rl")
USER_ERRORS = [
    (*PRETRAIN, ConfigMismatchError("the checkpoint's model.num_layers=2, the config's 3")),
    (*PRETRAIN, NoGoodCheckpointError("no step of runs/x reads", path="runs/x", attempts=[])),
    (*PRETRAIN, CheckpointError("hf checkpoint lacks model.norm.weight")),
    (*PRETRAIN, SafetensorsError("model.safetensors: header length 9 exceeds the file")),
    (*RL, EnvServerError("tasks directory 'nope' does not exist or is not a directory")),
    (*RL, CheckpointError("hf checkpoint lacks model.norm.weight")),
]


@pytest.mark.parametrize("argv, runner, error", USER_ERRORS)
def test_the_users_errors_from_inside_a_run_are_exit_2(argv, runner, error, monkeypatch, capsys, tmp_path):
    """Errors of what the user named (a checkpoint, a safetensors file, a tasks directory) are
    `UserError`s raised deep in the run: one line and exit 2, like a bad config value."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(runner, _raises(error))
    assert cli.main([*argv, f"train.out_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.endswith(f": error: {error}\n")


@pytest.mark.parametrize("argv, runner", [PRETRAIN, RL])
def test_a_file_not_found_from_inside_a_run_is_a_bug(argv, runner, monkeypatch, tmp_path):
    """A FileNotFoundError no user-facing check raised (a path the code built wrong) keeps its traceback."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(runner, _raises(FileNotFoundError(2, "No such file", "internal/state.json")))
    with pytest.raises(FileNotFoundError):
        cli.main([*argv, f"train.out_dir={tmp_path}"])


def test_eval_turns_only_user_errors_into_exit_2(monkeypatch, capsys, tmp_path):
    args = ["eval", "--tasks", str(tmp_path / "nope"), "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"]
    args += ["--out", str(tmp_path / "out")]
    monkeypatch.setattr("composer_jax.rl.rollout.env_servers.LocalEnvServers", _raises(EnvServerError("no tasks")))
    assert cli.main(args) == 2
    assert capsys.readouterr().err.endswith(": error: no tasks\n")
    monkeypatch.setattr("composer_jax.rl.rollout.env_servers.LocalEnvServers", _raises(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        cli.main(args)


def _module_path(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin)


def _cli_modules() -> list[Path]:
    """Every subcommand's module, and every module that builds a `composer-jax ...` argument parser
    (the `env` subcommands' own modules among them)."""
    paths = {_module_path(module) for module, _, _ in cli.SUBCOMMANDS.values()}
    paths |= {p for p in SRC.rglob("*.py") if 'prog="composer-jax' in p.read_text()}
    return sorted(paths)


def _is_stderr_print(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "print"
        and any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.value.keywords)
    )


def _sentinel_return(node: ast.stmt) -> bool:
    """`return`, `return None`, `return False` or `return 2`: what a print-and-bail block ends with."""
    return isinstance(node, ast.Return) and (
        node.value is None or (isinstance(node.value, ast.Constant) and node.value.value in (None, False, 2))
    )


def _blocks(tree: ast.AST):
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def test_cli_modules_are_found():
    names = {p.relative_to(SRC).as_posix() for p in _cli_modules()}
    assert {"env/cli.py", "env/mining/cli.py", "env/mining/swebench_import.py", "inference/server/cli.py"} <= names


def test_no_subcommand_module_returns_exit_code_2_itself():
    found = [
        f"{p.relative_to(SRC)}:{node.lineno}"
        for p in _cli_modules()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and node.value.value == 2
    ]
    assert not found, f"raise UsageError instead of returning 2 (composer_jax/cli.py turns it into exit 2): {found}"


def test_no_module_prints_an_error_and_returns_a_sentinel():
    """Anywhere in src/ but the dispatcher: print(..., file=sys.stderr) directly followed by a
    return of 2, None or False is a fault reported by sentinel; raise UsageError instead."""
    found = []
    for p in sorted(SRC.rglob("*.py")):
        if p == SRC / "cli.py":
            continue
        for block in _blocks(ast.parse(p.read_text())):
            found += [
                f"{p.relative_to(SRC)}:{b.lineno}"
                for a, b in zip(block, block[1:])
                if _is_stderr_print(a) and _sentinel_return(b)
            ]
    assert not found, found


def test_a_generated_env_server_token_can_be_passed_back_as_an_option(monkeypatch):
    """A token that starts with "-" cannot follow `--token` on a command line (argparse reads it as
    an option; tests/env/api/test_client.py's second server failed to start 1 run in 64)."""
    from composer_jax.env import cli as env_cli

    drawn = iter(["-starts-with-a-dash-0123456789abcdefghijklmnop", "fine-0123456789abcdefghijklmnopqrstuvwxyz"])
    monkeypatch.setattr(env_cli.secrets, "token_urlsafe", lambda n: next(drawn))
    assert env_cli._fresh_token() == "fine-0123456789abcdefghijklmnopqrstuvwxyz"

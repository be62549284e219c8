"""`composer-jax pretrain|sft` reject bad input with a clear message and exit code 2."""

from pathlib import Path

import pytest

from composer_jax.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
STAGE1 = str(REPO / "configs/pretrain/tiny_stage1.yaml")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--config", "no/such.yaml"], "does not exist"),
        (["--config", STAGE1, "train.micro_batches=3"], "train.batch_size=8 is not divisible by train.micro_batches=3"),
        (["--config", STAGE1, "data.sources=[{type: csv, path: x}]"], "data.sources[0].type='csv'"),
        (["--config", STAGE1, "model.vocab_size=100"], "model.vocab_size >= 2048"),
    ],
)
def test_pretrain_bad_input(argv, fragment, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli_main(["pretrain", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_sft_needs_chat_format(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli_main(["sft", "--config", STAGE1]) == 2
    assert "data.format='chat'" in capsys.readouterr().err

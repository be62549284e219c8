"""DataConfig through the YAML loader: a list of SourceConfig mappings becomes a tuple of dataclasses."""

import dataclasses

import pytest

from composer_jax.cli import main as cli_main
from composer_jax.config import ConfigError, build_dataclass, coerce, to_dict
from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig, validate_data_config


def test_tuple_of_sections_from_yaml_lists():
    data = {
        "sources": [
            {"type": "directory", "path": "src", "weight": 2, "include": [".py", ".md"]},
            {"type": "jsonl", "path": "a.jsonl"},
        ],
        "eval_fraction": 0.1,
    }
    cfg = build_dataclass(DataConfig, data, "data")
    assert cfg.sources == (
        SourceConfig(type="directory", path="src", weight=2.0, include=(".py", ".md")),
        SourceConfig(type="jsonl", path="a.jsonl"),
    )
    assert hash(cfg)  # frozen and hashable: tuples, not lists
    # to_dict writes lists back, and building from that gives the same config
    assert build_dataclass(DataConfig, to_dict(cfg), "data") == cfg


def test_tuple_errors_name_the_element():
    with pytest.raises(ConfigError, match=r"data.sources\[1\].type='csv' is not accepted"):
        build_dataclass(DataConfig, {"sources": [{"path": "a"}, {"type": "csv", "path": "b"}]}, "data")
    with pytest.raises(ConfigError, match=r"data.sources: expected a list"):
        build_dataclass(DataConfig, {"sources": {"path": "a"}}, "data")
    with pytest.raises(ConfigError, match=r"unknown key 'data.sources\[0\].pth'"):
        build_dataclass(DataConfig, {"sources": [{"pth": "a"}]}, "data")
    assert coerce([1, "x"], tuple[int, str], "k") == (1, "x")


def test_validate_data_config_messages():
    with pytest.raises(DataConfigError, match="data.sources is empty"):
        validate_data_config(DataConfig())
    bad = DataConfig(sources=(SourceConfig(path="x", weight=0.0),))
    with pytest.raises(DataConfigError, match=r"data.sources\[0\].weight=0.0 must be > 0"):
        validate_data_config(bad)
    chat_dir = DataConfig(format="chat", sources=(SourceConfig(type="directory", path="src"),))
    with pytest.raises(DataConfigError, match="accepts jsonl, parquet, arrayrecord"):
        validate_data_config(chat_dir)
    validate_data_config(dataclasses.replace(bad, sources=(SourceConfig(path="x"),)))


def test_data_config_module_does_not_import_jax():
    import subprocess
    import sys

    code = "import sys, composer_jax.config.data; assert 'jax' not in sys.modules and 'grain' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_data_peek_cli_reads_a_yaml_data_section(tmp_path, tok_dir, capsys):
    from composer_jax.data.cli import main

    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "m.py").write_text("def hello():\n    return 'world'\n")
    (tmp_path / "c.yaml").write_text(
        f"data:\n  tokenizer: {tok_dir}\n  eval_fraction: 0.0\n"
        f"  sources:\n    - {{type: directory, path: {tmp_path / 'code'}}}\n"
    )
    assert main(["peek", "--config", str(tmp_path / "c.yaml"), "--seq-len", "64", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- row 0:" in out and "def hello()" in out
    (tmp_path / "bad.yaml").write_text("data:\n  sources: [{type: csv, path: x}]\n")
    assert cli_main(["data", "peek", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "type='csv' is not accepted" in capsys.readouterr().err

"""One decision of a checkpoint directory's kind (`hf/checkpoint_kind.py`) for both of its readers:
`hf/init_from.py` (`train.init_from`, `model.from`, the RL restore) and the serve side's
`load_policy` (`serve`, `sample`, `eval --checkpoint`, `/admin/load_weights`). The same directory is
the same kind, read from the same place, to both; the same directories are refused by both."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import pytest

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.checkpoint.validate import CheckpointError
from composer_jax.config import CheckpointConfig, ConfigError, load_config, to_dict
from composer_jax.hf.checkpoint_kind import CheckpointDir, detect
from composer_jax.hf.init_from import open_source
from composer_jax.hf.weights import save_pretrained
from composer_jax.inference.server.policy import load_policy
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.state import init_train_state

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A run directory holding checkpoints/ (one saved step), a Hugging Face directory of the same
    model, one with its config.json only, and a directory that is no checkpoint."""
    root = tmp_path_factory.mktemp("kinds")
    cfg = load_config(
        str(REPO / "configs" / "model" / "tiny.yaml"),
        ["model.vocab_size=512", "model.num_layers=2", "model.max_position_embeddings=64", "mesh.fsdp=1"],
        num_devices=None,
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = init_train_state(cfg, mesh, ShardingRules.create(cfg.sharding_rules))
    with TrainCheckpointer(CheckpointConfig(directory=str(root / "run" / "checkpoints"), save_every=1)) as ck:
        ck.save(1, state, config=to_dict(cfg))
    save_pretrained(state.params, cfg.model, root / "hf")
    (root / "config_only").mkdir()
    shutil.copy(root / "hf" / "config.json", root / "config_only" / "config.json")
    (root / "neither").mkdir()
    (root / "neither" / "notes.txt").write_text("x")
    return {
        "checkpoints": root / "run" / "checkpoints",
        "run": root / "run",
        "hf": root / "hf",
        "config_only": root / "config_only",
        "neither": root / "neither",
    }


@pytest.mark.parametrize(
    "name, kind, read_from",
    [("checkpoints", "run", "checkpoints"), ("run", "run", "checkpoints"), ("hf", "hf", "hf")],
)
def test_both_readers_take_a_directory_as_the_same_kind(dirs, name, kind, read_from):
    path = str(dirs[name])
    assert detect(path) == CheckpointDir(kind, path, str(dirs[read_from]))
    source, saved = open_source(path)
    policy = load_policy(path)
    assert (source.kind, source.where) == (policy.kind, str(dirs[read_from])) == (kind, str(dirs[read_from]))
    assert policy.path == path and policy.cfg == saved
    assert policy.step == (1 if kind == "run" else None) and source.step == policy.step


# each reader as the user reaches it, with the key its errors name
READERS = {
    "train.init_from": lambda path: open_source(path),
    "model.from": lambda path: open_source(path, key="model.from"),
    "--checkpoint": lambda path: load_policy(path, key="--checkpoint"),
    "checkpoint": lambda path: load_policy(path),  # /admin/load_weights
}


def test_a_hugging_face_directory_without_weights_is_refused_by_both_naming_what_is_missing(dirs):
    path = str(dirs["config_only"])
    for key, read in READERS.items():
        with pytest.raises(CheckpointError) as e:
            read(path)
        message = str(e.value)
        assert message.startswith(f"{key}={path!r}: a Hugging Face checkpoint directory without its weights")
        assert "holds config.json but neither model.safetensors nor model.safetensors.index.json" in message
        assert e.value.path == path


@pytest.mark.parametrize("name", ["neither", "missing"])
def test_a_directory_of_no_kind_is_refused_by_both_naming_it_and_what_is_accepted(dirs, tmp_path, name):
    path = str(dirs.get(name, tmp_path / name))
    errors = []
    for key, read in READERS.items():
        with pytest.raises(ConfigError) as e:
            read(path)
        assert str(e.value).startswith(f"{key}={path!r}: ")
        errors.append(str(e.value).removeprefix(f"{key}={path!r}: "))
    assert len(set(errors)) == 1, errors  # one message, whoever reads
    why = "not a directory" if name == "missing" else "none of the three kinds of checkpoint (it holds ['notes.txt'])"
    assert errors[0].startswith(why)
    assert all(k in errors[0] for k in ("accepted:", "checkpoints/", "config.json + model.safetensors", "--to-orbax"))


def test_an_object_store_url_is_a_run_to_both():
    url = "gs://bucket/runs/tiny/stage2/checkpoints"
    assert detect(url) == CheckpointDir("run", url, url)

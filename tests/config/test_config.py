"""Config loading: overrides, unknown keys, wrong types, impossible combinations."""

from pathlib import Path

import pytest

import composer_jax as cj
from composer_jax.config import ConfigError, MeshConfig, parse_overrides

TINY = str(Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml")


def test_load_and_override():
    cfg = cj.load_config(TINY, overrides=["model.num_layers=2", "mesh.fsdp=4", "mesh.expert=2"])
    assert cfg.model.num_layers == 2 and cfg.mesh.fsdp == 4 and cfg.mesh.expert == 2
    assert cfg.model.rope_scaling.type == "none"
    cfg = cj.load_config(TINY, ["model.rope_scaling={type: yarn, factor: 4.0, original_max_position_embeddings: 64}"])
    assert cfg.model.rope_scaling.factor == 4.0
    cfg = cj.load_config(TINY, ["model.rope_scaling.type=yarn"])
    assert cfg.model.rope_scaling.type == "yarn"
    assert cfg.model.num_moe_layers == 2 and cfg.model.num_dense_layers == 1


@pytest.mark.parametrize(
    "override, fragments",
    [
        (["model.num_layer=2"], ["model.num_layer", "did you mean 'num_layers'"]),
        (["modle.x=1"], ["'modle'", "accepted keys"]),
        (["model.num_layers=two"], ["model.num_layers='two'", "integer"]),
        (["model.score_func=relu"], ["model.score_func='relu'", "'sigmoid'", "'softmax'"]),
        (["model.tie_word_embeddings=3"], ["model.tie_word_embeddings=3", "boolean"]),
        (
            ["model.num_heads=6", "mesh.tensor=4", "mesh.fsdp=2"],
            ["num_heads=6", "mesh.tensor=4", "accepted tensor sizes: [1, 2, 3, 6]"],
        ),
        (
            ["model.num_experts=6", "model.n_group=3", "mesh.expert=4", "mesh.fsdp=2"],
            ["num_experts=6", "mesh.expert=4"],
        ),
        (["mesh.fsdp=3"], ["= 3", "8 devices"]),
        (["mesh.fsdp=-1", "mesh.data=-1"], ["at most one axis may be -1"]),
        (["model.n_group=3"], ["n_group=3", "num_experts=8"]),
        (["model.topk_group=1", "model.num_experts_per_tok=3"], ["topk_group=1", "num_experts_per_tok=3"]),
        (["model.num_layers=2", "model.num_layers=3"], ["given twice"]),
        (["model.num_layers"], ["key=value"]),
        (["model.qk_rope_head_dim=7"], ["qk_rope_head_dim=7", "even"]),
    ],
)
def test_bad_configs_name_key_value_and_accepted(override, fragments):
    with pytest.raises(ConfigError) as e:
        cj.load_config(TINY, overrides=override, num_devices=8)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        cj.load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        cj.load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at top level"):
        cj.load_config(lst)


def test_base_composition(tmp_path):
    (tmp_path / "mesh.yaml").write_text("mesh: {fsdp: 2, expert: 4}\n")
    top = tmp_path / "top.yaml"
    top.write_text(f"base: [{TINY}, mesh.yaml]\nmodel: {{num_layers: 2}}\n")
    cfg = cj.load_config(top, num_devices=8)
    assert cfg.mesh.expert == 4 and cfg.model.num_layers == 2 and cfg.model.name == "tiny"


def test_mesh_shape_and_overrides_parse():
    assert MeshConfig(data=2, fsdp=-1).shape(8) == {"data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
    assert parse_overrides(["a.b=[1, 2]", "c={x: 1}"]) == [(["a", "b"], [1, 2]), (["c"], {"x": 1})]


def test_sharding_rules_reject_axis_used_twice():
    from composer_jax.sharding import ShardingRules

    rules = ShardingRules.create({"embed": ["fsdp", "expert"]})
    with pytest.raises(ConfigError, match="mesh axis 'expert' twice"):
        rules.spec(("experts", "embed", "expert_mlp"))
    with pytest.raises(ConfigError, match="unknown mesh axis 'model'"):
        ShardingRules.create({"embed": "model"})
    with pytest.raises(ConfigError, match="unknown logical axis 'embedding'"):
        ShardingRules.create({"embedding": "fsdp"})


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(TINY).parents[1] / "pretrain").glob("*.yaml")))
def test_stage_configs_load(name):
    cfg = cj.load_config(Path(TINY).parents[1] / "pretrain" / name, num_devices=None)
    assert cfg.data.sources and cfg.train.steps > 0
    if "stage2" in name:  # the long-context stage extends RoPE with YaRN and uses context parallelism
        assert cfg.model.rope_scaling.type == "yarn" and cfg.mesh.context > 1 and cfg.train.mtp_loss == "self_distill"
    if "sft" in name:
        assert cfg.data.format == "chat" and cfg.train.init_from


def test_explicit_rule_that_splits_nothing_is_warned_about():
    import jax
    import pytest

    from composer_jax.config import MeshConfig, ModelConfig
    from composer_jax.model.params import param_shardings
    from composer_jax.sharding import ShardingRules, make_mesh

    mesh = make_mesh(MeshConfig(fsdp=4, data=2))
    odd = ModelConfig(vocab_size=509)  # 509 is not a multiple of data=2
    with pytest.warns(UserWarning, match=r"sharding_rules.vocab maps to mesh axis 'data'.*stay replicated"):
        sh = param_shardings(odd, mesh, ShardingRules.create({"vocab": ["data"]}))
    assert sh["embed"].spec == jax.sharding.PartitionSpec(None, "fsdp")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule that applies, and the defaults, say nothing
        sh = param_shardings(ModelConfig(vocab_size=512), mesh, ShardingRules.create({"vocab": ["data"]}))
        assert sh["embed"].spec == jax.sharding.PartitionSpec("data", "fsdp")
        param_shardings(odd, mesh, ShardingRules.create())


def test_exponent_without_a_dot_is_a_number_not_a_string():
    """YAML 1.1 resolves `1e-6` to a string; a float field takes it (and `1.5E+3`), not `1e` or `x`."""
    cfg = cj.load_config(TINY, ["train.optimizer.lr=1e-6", "train.optimizer.weight_decay=2E-2"])
    assert cfg.train.optimizer.lr == 1e-6 and cfg.train.optimizer.weight_decay == 0.02
    for bad in ("1e", "x", "1e-6e"):
        with pytest.raises(cj.ConfigError, match=f"train.optimizer.lr='{bad}': expected a number"):
            cj.load_config(TINY, [f"train.optimizer.lr={bad}"])

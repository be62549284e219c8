"""`composer-jax convert --from-run` of a `train.lora` run's checkpoint (hf/convert.py, `--lora`):
the merged model, the frozen base and the PEFT adapter. The default test reads the exports back
with our own loader (the base reloaded from train.seed on one device equals the run's; merged =
W + scale A B); the slow one is the oracle: transformers loads the merged export, PEFT applies the
adapter export to the base export, and both give our logits within 1e-4."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from support.live_env import REPO
from support.lora_run import lora_config, save_lora_run

import composer_jax as cj
from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import to_dict
from composer_jax.config.checkpoint import CheckpointConfig
from composer_jax.errors import UsageError
from composer_jax.hf.convert import main as convert_main
from composer_jax.hf.lora_export import CONFIG_NAME, WEIGHTS_NAME, peft_tensors
from composer_jax.model import lora

TOL = 1e-4


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(run directory, its config, its saved state) of a LoRA run checkpointed at step 3."""
    root = tmp_path_factory.mktemp("lora_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        cfg, state = save_lora_run(root)
    return root, cfg, state


def _convert(args: list[str]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the run's tokenizer path is relative to where it ran
        assert convert_main(args) == 0


def _close(a, b, tol: float) -> None:
    fa = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(a))}
    fb = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(b))}
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(fa[k], fb[k], rtol=0, atol=tol, err_msg=k)


def test_convert_lora_run_to_a_peft_adapter(tmp_path) -> None:
    """--lora peft writes the checkpoint's adapters as PEFT's files (the base is not read); --lora
    on a full fine-tuning run, without --from-run/--to-hf, or with a flag it would ignore, is
    refused. (The checkpoint holds {params: adapters} and the run config: all convert reads of a
    LoRA run; the merged and base exports: the slow test below.)"""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        cfg = lora_config(tmp_path / "run")
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(np.float32), lora.abstract_adapters(cfg.model, cfg.train.lora)
    )
    run = tmp_path / "run"
    with TrainCheckpointer(CheckpointConfig(directory=str(run / "checkpoints"), save_every=1)) as ck:
        ck.save(3, {"params": adapters, "step": np.int32(3)}, config=to_dict(cfg))
    _convert(["--from-run", str(run), "--to-hf", str(tmp_path / "peft"), "--lora", "peft"])
    config = json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    got = load_file(str(tmp_path / "peft" / WEIGHTS_NAME))
    want, modules = peft_tensors(adapters, cfg.model)
    assert got.keys() == want.keys() and sorted(config["target_modules"]) == modules
    assert all(np.array_equal(got[k], want[k]) for k in want)

    with pytest.raises(UsageError, match="--lora peft.*without --dtype"):
        convert_main(["--from-run", str(run), "--to-hf", str(tmp_path / "x"), "--lora", "peft", "--dtype", "bfloat16"])
    with pytest.raises(UsageError, match="--lora merged applies to --from-run with --to-hf"):
        convert_main(["--from-hf", str(tmp_path / "peft"), "--to-hf", str(tmp_path / "y"), "--lora", "merged"])
    full = tmp_path / "full"  # a full fine-tuning run's checkpoint (only its run config is read)
    with TrainCheckpointer(CheckpointConfig(directory=str(full), save_every=1)) as ck:
        ck.save(1, {"params": {"w": np.zeros(2, np.float32)}}, config={"model": {}, "train": {"lora": {"rank": 0}}})
    with pytest.raises(UsageError, match="not a LoRA run"):
        convert_main(["--from-run", str(full), "--to-hf", str(tmp_path / "z"), "--lora", "base"])


# slow: 8 s of compiling (the seed's model, its quantisation and dequantisation, three round trips);
# the default suite keeps the dequantised base's equality to what the trainer computes with in
# tests/model/test_quant_base.py (`test_forward_equals_the_dequantised_base`)
@pytest.mark.slow
def test_a_quantised_runs_base_is_its_dequantised_base(tmp_path) -> None:
    """A run with train.lora.base_format=mxfp8 trained over its base's codes: the base that
    `convert --lora base` / `--lora merged` and serve replicas read (`load_lora_run`) is those codes
    dequantised: each layer kernel is quant/formats.py's MXFP8 (E4M3, "ceil" scales) round trip of
    the seed's weight along its input axis, every other leaf (norms, router, embedding, head) the
    seed's bit for bit."""
    from composer_jax.checkpoint.manager import read_run_config
    from composer_jax.hf.lora_export import load_lora_run
    from composer_jax.model.params import init_params
    from composer_jax.quant.formats import fake_quantize

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        cfg = lora_config(tmp_path / "run", ["train.lora.base_format=mxfp8"])
    adapters = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), lora.abstract_adapters(cfg.model, cfg.train.lora))
    ckpt = tmp_path / "run" / "checkpoints"
    with TrainCheckpointer(CheckpointConfig(directory=str(ckpt), save_every=1)) as ck:
        ck.save(3, {"params": adapters, "step": np.int32(3)}, config=to_dict(cfg))
    run = load_lora_run(ckpt, 3, read_run_config(ckpt, 3)[0])
    seed = jax.device_get(init_params(cfg.model, jax.random.key(cfg.train.seed)))
    got = jax.device_get(run.base)
    assert str(jax.tree.structure(got)) == str(jax.tree.structure(seed))
    for stack in ("dense_layers", "moe_layers"):
        np.testing.assert_array_equal(got[stack]["attn"]["kv_a_norm"], seed[stack]["attn"]["kv_a_norm"])
    for key in ("embed", "lm_head", "final_norm"):
        np.testing.assert_array_equal(got[key], seed[key])
    np.testing.assert_array_equal(got["moe_layers"]["moe"]["router"], seed["moe_layers"]["moe"]["router"])
    for path, axis in (
        (("moe_layers", "attn", "q_a"), 1),
        (("moe_layers", "moe", "down"), 2),
        (("dense_layers", "attn", "o"), 2),
    ):
        w, ours = seed, got
        for k in path:
            w, ours = w[k], ours[k]
        want = np.asarray(fake_quantize(jnp.asarray(w), "mxfp8_e4m3", axis, rule="ceil"))
        np.testing.assert_array_equal(ours, want)
        assert not np.array_equal(ours, w)


@pytest.mark.slow
@pytest.mark.hf
def test_transformers_and_peft_load_the_exports_and_logits_match(lora_run, tmp_path) -> None:
    """(slow: 15-20 s, a LoRA run's state made and saved, transformers and PEFT building the
    models; the default test above keeps the PEFT export of the checkpoint's adapters.) --lora base
    writes the run's frozen base bit for bit (the fresh model of train.seed, made again on one
    device), --lora merged (the default) W + scale A B; the merged export in transformers, and
    PEFT's adapter over the base export, give the logits of our adapted forward (factored adapters,
    model/lora.py) within 1e-4; the adapters move the logits by far more."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    run, cfg, state = lora_run
    _convert(["--from-run", str(run), "--to-hf", str(tmp_path / "merged")])  # --lora merged: the default
    for mode in ("base", "peft"):
        _convert(["--from-run", str(run), "--to-hf", str(tmp_path / mode), "--lora", mode])
    _close(cj.from_pretrained(tmp_path / "base")[1], state.frozen, 0.0)
    _close(
        cj.from_pretrained(tmp_path / "merged")[1], lora.merged(state.frozen, state.params, cfg.train.lora.scale), 1e-6
    )

    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 24)).astype(np.int32)
    base, adapters = jax.device_get(state.frozen), jax.device_get(state.params)
    m = cfg.model

    @jax.jit
    def logits(base, adapters, t):
        return cj.forward(lora.join(base, adapters, cfg.train.lora.scale), t, m).logits, cj.forward(base, t, m).logits

    ours, plain = (np.asarray(x, np.float64) for x in logits(base, adapters, jnp.asarray(tokens)))
    auto = transformers.AutoModelForCausalLM
    t = torch.as_tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        merged = auto.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        ref_merged = merged(t).logits.float().numpy()
        peft_model = peft.PeftModel.from_pretrained(
            auto.from_pretrained(tmp_path / "base", dtype=torch.float32).eval(), str(tmp_path / "peft")
        ).eval()
        ref_peft = peft_model(t).logits.float().numpy()
    d_merged, d_peft = (float(np.abs(ours - r).max()) for r in (ref_merged, ref_peft))
    moved = float(np.abs(ours - plain).max())
    print(f"[lora convert] max|ours - hf merged| = {d_merged:.2e}, |ours - peft| = {d_peft:.2e}; moved {moved:.2e}")
    assert moved > 10 * TOL
    assert d_merged < TOL and d_peft < TOL

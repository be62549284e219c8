"""The HF export's MLA padding for vLLM, measured with transformers (the oracle).

A tiny MoE of the demo's shape (YaRN factor 2 from 256 positions, max_position_embeddings 4096,
kv_lora_rank 32 + qk_rope_head_dim 8) is saved as a training checkpoint, exported by
`composer-jax convert --from-run` with and without `--pad-mla-for-vllm` (512 + 64), and both
directories are loaded with transformers' AutoModelForCausalLM in float32. Printed: the convert
times, the largest logit difference between the two over `--positions` positions spread over the
whole context, the largest logit, whether `--greedy` greedy tokens agree, and both exports' YaRN
fields. Usage: python bench/export_pad.py [--positions 1024] [--greedy 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

YARN = "{type: yarn, factor: 2.0, original_max_position_embeddings: 256, mscale: 1.0, mscale_all_dim: 1.0}"


def _save_run(root: Path) -> None:
    from composer_jax.checkpoint.manager import TrainCheckpointer
    from composer_jax.config import load_config, to_dict
    from composer_jax.config.checkpoint import CheckpointConfig
    from composer_jax.sharding import ShardingRules, make_mesh
    from composer_jax.train.state import init_train_state

    overrides = ["model.vocab_size=2048", "model.num_layers=2", f"model.rope_scaling={YARN}", "mesh.fsdp=1"]
    cfg = load_config("configs/model/tiny.yaml", [*overrides, "data.tokenizer=assets/tokenizer"], num_devices=None)
    state = init_train_state(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), ShardingRules.create(cfg.sharding_rules))
    with TrainCheckpointer(CheckpointConfig(directory=str(root / "checkpoints"), save_every=1)) as ck:
        ck.save(1, state, config=to_dict(cfg))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", type=int, default=1024)
    p.add_argument("--greedy", type=int, default=256)
    args = p.parse_args()
    import torch
    import transformers

    from composer_jax.hf.convert import main as convert

    root = Path(tempfile.mkdtemp(prefix="export_pad_"))
    _save_run(root)
    models = {}
    for name, extra in (("plain", []), ("padded", ["--pad-mla-for-vllm"])):
        t = time.perf_counter()
        assert convert(["--from-run", str(root), "--to-hf", str(root / name), *extra]) == 0
        print(f"convert {name}: {time.perf_counter() - t:.2f} s")
        rope = json.loads((root / name / "config.json").read_text())["rope_parameters"]
        print(f"  rope_parameters: {rope}")
        models[name] = transformers.AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).eval()
    n = args.positions
    tokens = torch.tensor([np.random.default_rng(0).integers(0, 2048, n).tolist()])
    positions = torch.tensor([np.linspace(0, 4095, n).astype(np.int64).tolist()])
    with torch.no_grad():
        a, b = (models[k](tokens, position_ids=positions).logits for k in ("plain", "padded"))
    print(
        f"max |logit difference| over {n} positions 0..4095: {float((a - b).abs().max()):.3g} "
        f"(max |logit| {float(a.abs().max()):.3g})"
    )
    ga, gb = (models[k].generate(tokens[:, :16], max_new_tokens=args.greedy, do_sample=False) for k in models)
    print(f"greedy tokens equal over {args.greedy}: {bool((ga == gb).all())}")


if __name__ == "__main__":
    main()

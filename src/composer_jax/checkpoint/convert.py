"""`composer-jax convert`: Hugging Face safetensors <-> composer_jax (orbax) checkpoints.

    composer-jax convert --from-hf DIR --print-config              # the ModelConfig it maps to (YAML)
    composer-jax convert --from-hf DIR --to-hf OUT [--dtype bfloat16] [--max-shard-size 5GB]
    composer-jax convert --from-hf DIR --to-orbax OUT              # OUT/params (orbax) + OUT/model.yaml
    composer-jax convert --from-orbax DIR --to-hf OUT

--from-hf then --to-hf rewrites a checkpoint in the hub per-expert layout: FP8 block-quantised weights
are dequantised, fused in-memory expert tensors split, MTP modules kept. The whole model passes
through host memory once (one parameter at a time is gathered when writing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax convert",
        description=__doc__,
        epilog="Supported Hugging Face model_types: deepseek_v3 (and Kimi K2), deepseek_v2, qwen3_moe. "
        "See docs/hf_interop.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="HF checkpoint directory (config.json + *.safetensors)")
    src.add_argument("--from-orbax", metavar="DIR", help="directory written by --to-orbax (params/ + model.yaml)")
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--to-hf", metavar="OUT", help="write an HF checkpoint directory")
    dst.add_argument("--to-orbax", metavar="OUT", help="write OUT/params (orbax) and OUT/model.yaml")
    dst.add_argument("--print-config", action="store_true", help="print the mapped ModelConfig as YAML and exit")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="parameter dtype (default: the source's; FP8 sources dequantise to it)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file for --to-hf (default 5GB)")
    return p


def _orbax_save(params: dict, cfg, out: Path) -> None:
    import orbax.checkpoint as ocp

    from composer_jax.config import to_dict

    out.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(out.resolve() / "params", params)
    ckpt.wait_until_finished()
    (out / "model.yaml").write_text(yaml.safe_dump({"model": to_dict(cfg)}, sort_keys=False))


def load_orbax(src: Path, dtype: str | None):
    """(ModelConfig, params) from a directory written by --to-orbax (params/ + model.yaml); dtype
    "float32"/"bfloat16" casts the parameters (None: as saved)."""
    import dataclasses

    import orbax.checkpoint as ocp

    from composer_jax.config import ConfigError, config_from_dict
    from composer_jax.config.model import as_dtype
    from composer_jax.model.params import abstract_params

    if not (src / "model.yaml").exists():
        raise ConfigError(f"--from-orbax {src}: no model.yaml; expected a directory written by --to-orbax")
    cfg = config_from_dict(yaml.safe_load((src / "model.yaml").read_text()), num_devices=None).model
    params = ocp.StandardCheckpointer().restore(src.resolve() / "params", abstract_params(cfg))
    if dtype and dtype != cfg.param_dtype:
        import jax

        dt = as_dtype(dtype, "--dtype")
        cfg = dataclasses.replace(cfg, param_dtype=dt, compute_dtype=dt)
        # abstract_params carries each leaf's dtype (routers stay float32)
        params = jax.tree.map(lambda x, w: x.astype(w.dtype), params, abstract_params(cfg))
    return cfg, params


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from composer_jax.checkpoint.hf import CheckpointError, from_pretrained, save_pretrained
    from composer_jax.config import ConfigError, to_dict

    try:
        if args.from_hf:
            if args.print_config:
                from composer_jax.checkpoint.hf import read_hf_config
                from composer_jax.checkpoint.hf_config import model_config_from_hf

                cfg, info = model_config_from_hf(read_hf_config(args.from_hf), dtype=args.dtype)
                print(yaml.safe_dump({"model": to_dict(cfg)}, sort_keys=False), end="")
                print(
                    f"# requested MTP layers: {info.requested_mtp_layers} (loaded if present); "
                    f"fp8 block: {info.fp8_block}"
                )
                return 0
            cfg, params = from_pretrained(args.from_hf, dtype=args.dtype)
        else:
            if args.print_config:
                print("--print-config needs --from-hf", file=sys.stderr)
                return 2
            cfg, params = load_orbax(Path(args.from_orbax), args.dtype)
        if args.to_hf:
            out = save_pretrained(params, cfg, args.to_hf, max_shard_size=args.max_shard_size)
        else:
            out = Path(args.to_orbax)
            _orbax_save(params, cfg, out)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"composer-jax convert: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {out} ({cfg.num_layers} layers, {cfg.num_experts} experts, {cfg.num_mtp_layers} MTP, {cfg.param_dtype})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

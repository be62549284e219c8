"""`composer-jax convert`: Hugging Face safetensors <-> composer_jax (orbax) checkpoints.

    composer-jax convert --from-hf DIR --print-config              # the ModelConfig it maps to (YAML)
    composer-jax convert --from-hf DIR --to-hf OUT [--dtype bfloat16] [--max-shard-size 5GB]
    composer-jax convert --from-hf DIR --to-orbax OUT              # OUT/params (orbax) + OUT/model.yaml
    composer-jax convert --from-orbax DIR --to-hf OUT
    composer-jax convert --from-run RUN [--step N] --to-hf OUT [--pad-mla-for-vllm] [--tokenizer T]

--from-run reads a training checkpoint: a run directory (holding checkpoints/), its checkpoint
directory (numbered step directories; the latest step, or --step) or one step's directory; the
model config is the run config saved with the step. --to-hf writes, beside config.json and the
safetensors, tokenizer.json (with the BOS the project prepends), tokenizer_config.json (special
tokens and the chat template), generation_config.json and a model card README.md, from
--tokenizer, else a tokenizer.json next to the source, else the run's data.tokenizer
(hf/export.py). --pad-mla-for-vllm pads MLA's latent and rotary dimensions to 512 + 64,
exactly (hf/mla_pad.py), for vLLM's MLA kernels.

--from-hf then --to-hf rewrites a checkpoint in the hub per-expert layout: FP8 block-quantised weights
are dequantised, fused in-memory expert tensors split, MTP modules kept. The whole model passes
through host memory once (one parameter at a time is gathered when writing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from composer_jax.errors import UsageError


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
    src.add_argument(
        "--from-run", metavar="RUN", help="training checkpoint: run dir, its checkpoints/ dir, or one step's dir"
    )
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
    p.add_argument("--step", type=_step, default=None, help="--from-run: the step to export (default: the latest)")
    p.add_argument("--tokenizer", default=None, help="--to-hf: tokenizer.json or its directory (default: found)")
    p.add_argument(
        "--pad-mla-for-vllm",
        action="store_true",
        help="--to-hf: pad MLA to kv_lora_rank 512 + qk_rope_head_dim 64 (exact), the sizes vLLM's MLA takes",
    )
    return p


def _step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step; accepted: a non-negative integer")
    return value


RUN_ACCEPTED = (
    "accepted: a training run directory holding checkpoints/, its checkpoint directory (numbered step "
    "directories, e.g. runs/tiny/stage3_sft/checkpoints) or one step's directory"
)


def load_run(path: Path, step: int | None):
    """(ModelConfig, host params, step, saved run config) of a training checkpoint (module help)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from composer_jax.checkpoint.manager import read_run_config, restore_params_only
    from composer_jax.checkpoint.validate import CheckpointError
    from composer_jax.config import ConfigError, config_from_dict
    from composer_jax.model.params import abstract_params

    if not path.is_dir():
        raise ConfigError(f"--from-run {str(path)!r}: not a directory; {RUN_ACCEPTED}")
    if (path / "checkpoints").is_dir() and not any(c.name.isdigit() for c in path.iterdir()):
        path = path / "checkpoints"
    try:
        saved, step = read_run_config(path, step)
        cfg = config_from_dict({"model": saved.get("model") or {}}, num_devices=None).model
        one = SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract_params(cfg))
        params = restore_params_only(path, target, step)
    except (CheckpointError, ValueError) as e:
        raise ConfigError(f"--from-run {str(path)!r}: {e}; {RUN_ACCEPTED}") from None
    return cfg, params, step, saved


def _find_tokenizer(args, source: Path, run_config: dict):
    """(Tokenizer or None, its directory): --tokenizer, else next to the source, else data.tokenizer."""
    from composer_jax.config.data import DataConfigError
    from composer_jax.formats.tokenizer import load_tokenizer

    where = args.tokenizer
    if where is None:
        for d in (source, source.parent, source.parent.parent):
            if (d / "tokenizer.json").is_file():
                where = str(d)
                break
    where = where or (run_config.get("data") or {}).get("tokenizer") or None
    if where is None:
        return None, None
    try:
        tok = load_tokenizer(where)
    except DataConfigError as e:
        if args.tokenizer:
            raise
        print(f"note: tokenizer {where!r} not used: {e}", file=sys.stderr)
        return None, None
    p = Path(where)
    return tok, (p if p.is_dir() else p.parent)


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


def _load(args):
    """(cfg, params, RunInfo) from the source flag."""
    from composer_jax.hf.export import RunInfo
    from composer_jax.hf.weights import from_pretrained

    if args.from_run:
        cfg, params, step, saved = load_run(Path(args.from_run), args.step)
        if args.dtype:
            cfg, params = _cast(cfg, params, args.dtype)
        return cfg, params, RunInfo(args.from_run, "training", step, saved)
    if args.from_hf:
        cfg, params = from_pretrained(args.from_hf, dtype=args.dtype)
        return cfg, params, RunInfo(args.from_hf, "Hugging Face")
    cfg, params = load_orbax(Path(args.from_orbax), args.dtype)
    return cfg, params, RunInfo(args.from_orbax, "orbax")


def _cast(cfg, params, dtype: str):
    import dataclasses

    import jax

    from composer_jax.config.model import as_dtype
    from composer_jax.model.params import abstract_params

    dt = as_dtype(dtype, "--dtype")
    cfg = dataclasses.replace(cfg, param_dtype=dt, compute_dtype=dt)
    return cfg, jax.tree.map(lambda x, w: x.astype(w.dtype), params, abstract_params(cfg))


def _print_hf_config(args) -> int:
    from composer_jax.config import to_dict
    from composer_jax.hf.config import model_config_from_hf
    from composer_jax.hf.weights import read_hf_config

    cfg, info = model_config_from_hf(read_hf_config(args.from_hf), dtype=args.dtype)
    print(yaml.safe_dump({"model": to_dict(cfg)}, sort_keys=False), end="")
    print(f"# requested MTP layers: {info.requested_mtp_layers} (loaded if present); fp8 block: {info.fp8_block}")
    return 0


def _check_flags(args) -> None:
    """UsageError for a flag given without the one it applies to."""
    if args.print_config and not args.from_hf:
        raise UsageError("--print-config needs --from-hf")
    if args.step is not None and not args.from_run:
        raise UsageError("--step applies to --from-run only")
    if (args.pad_mla_for_vllm or args.tokenizer) and not args.to_hf:
        raise UsageError("--pad-mla-for-vllm and --tokenizer apply to --to-hf only")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from composer_jax.checkpoint.validate import CheckpointError
    from composer_jax.config import ConfigError
    from composer_jax.hf.export import export_hf

    _check_flags(args)
    try:
        if args.print_config:
            return _print_hf_config(args)
        cfg, params, info = _load(args)
        if args.to_hf:
            source = Path(args.from_run or args.from_hf or args.from_orbax)
            tok, tok_dir = _find_tokenizer(args, source, info.run_config)
            done = export_hf(
                params,
                cfg,
                args.to_hf,
                tok=tok,
                source=info,
                tokenizer_source=tok_dir,
                pad_mla_for_vllm=args.pad_mla_for_vllm,
                max_shard_size=args.max_shard_size,
            )
            out, cfg = done.out, done.cfg
            for note in done.notes:
                print(f"note: {note}", file=sys.stderr)
        else:
            out = Path(args.to_orbax)
            _orbax_save(params, cfg, out)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"composer-jax convert: {e}", file=sys.stderr)
        return 1
    step = f" step {info.step}" if info.step is not None else ""
    print(
        f"wrote {out} from {info.kind} checkpoint{step} ({cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"{cfg.num_mtp_layers} MTP, {cfg.param_dtype})"
    )
    return 0

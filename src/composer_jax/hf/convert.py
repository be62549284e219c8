"""`composer-jax convert`: Hugging Face safetensors <-> composer_jax (orbax) checkpoints.

    composer-jax convert --from-hf DIR --print-config              # the ModelConfig it maps to (YAML)
    composer-jax convert --from-hf DIR --to-hf OUT [--dtype bfloat16] [--max-shard-size 5GB]
    composer-jax convert --from-hf DIR --to-orbax OUT              # OUT/params (orbax) + OUT/model.yaml
    composer-jax convert --from-orbax DIR --to-hf OUT
    composer-jax convert --from-run RUN [--step N] --to-hf OUT [--pad-mla-for-vllm] [--tokenizer T]
    composer-jax convert --from-run LORA_RUN --to-hf OUT --lora {merged,peft,base}

--from-run reads a training checkpoint: a run directory (holding checkpoints/), its checkpoint
directory (numbered step directories; the latest step, or --step) or one step's directory; the
model config is the run config saved with the step. --to-hf writes, beside config.json and the
safetensors, tokenizer.json (with the BOS the project prepends), tokenizer_config.json (special
tokens and the chat template), generation_config.json and a model card README.md, from
--tokenizer, else a tokenizer.json next to the source, else the run's data.tokenizer
(hf/export.py). --pad-mla-for-vllm pads MLA's latent and rotary dimensions to 512 + 64,
exactly (hf/mla_pad.py), for vLLM's MLA kernels.

A `train.lora` run's checkpoint holds its adapters, not the model; its frozen base is where the run
took it (the saved run config's train.init_from, else the fresh model of train.seed; read from the
directory the run was started in). --lora merged (the default) writes the adapted model, every
adapted W replaced by W + alpha/rank A B; --lora base writes the frozen base; --lora peft writes
OUT/adapter_config.json + OUT/adapter_model.safetensors, a PEFT LoRA adapter that
`peft.PeftModel.from_pretrained` applies to the base (--lora base's export, or the Hugging Face
checkpoint train.init_from names): attention targets only (hf/lora_export.py).

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
    p.add_argument(
        "--lora",
        choices=LORA_EXPORTS,
        default=None,
        help="--from-run of a train.lora run, --to-hf: the merged model (default), a PEFT adapter, or the base",
    )
    return p


LORA_EXPORTS = ("merged", "peft", "base")


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


def load_run(path: Path, step: int | None, lora: str | None = None):
    """(ModelConfig, host params, step, saved run config) of a training checkpoint (module help).
    A `train.lora` run's: the parameters `lora` names (merged, the default, or base); None for
    "peft" (`load_lora_run` reads the adapters)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from composer_jax.checkpoint.manager import read_run_config, restore_params_only
    from composer_jax.checkpoint.validate import CheckpointError
    from composer_jax.config import ConfigError, config_from_dict
    from composer_jax.hf.lora_export import load_lora_run, lora_run_config
    from composer_jax.model.params import abstract_params

    path = run_checkpoints(path)
    try:
        saved, step = read_run_config(path, step)
        lora_cfg = lora_run_config(saved)
        if lora_cfg is not None and lora == "peft":
            return lora_cfg.model, None, step, saved
        if lora_cfg is not None:
            run = load_lora_run(path, step, saved)
            params = run.base if lora == "base" else run.merged()
            return run.cfg.model, params, step, saved
        if lora is not None:
            raise UsageError(
                f"--lora {lora}: --from-run {str(path)!r} is not a LoRA run (its train.lora.rank=0: the "
                "checkpoint holds the whole model); accepted: --lora with a train.lora run's checkpoint"
            )
        cfg = config_from_dict({"model": saved.get("model") or {}}, num_devices=None).model
        one = SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract_params(cfg))
        params = restore_params_only(path, target, step)
    except (CheckpointError, ValueError) as e:
        raise ConfigError(f"--from-run {str(path)!r}: {e}; {RUN_ACCEPTED}") from None
    return cfg, params, step, saved


def run_checkpoints(path: Path) -> Path:
    """The checkpoint directory of --from-run's `path` (a run directory's checkpoints/)."""
    from composer_jax.config import ConfigError

    if not path.is_dir():
        raise ConfigError(f"--from-run {str(path)!r}: not a directory; {RUN_ACCEPTED}")
    if (path / "checkpoints").is_dir() and not any(c.name.isdigit() for c in path.iterdir()):
        return path / "checkpoints"
    return path


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
        cfg, params, step, saved = load_run(Path(args.from_run), args.step, args.lora)
        if args.dtype and params is not None:
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
    if args.lora is not None and not (args.from_run and args.to_hf):
        raise UsageError(f"--lora {args.lora} applies to --from-run with --to-hf only")
    if args.lora == "peft" and (args.dtype or args.pad_mla_for_vllm or args.tokenizer):
        raise UsageError(
            "--lora peft writes the adapters alone (float32, the base's shapes); accepted: --lora peft without "
            "--dtype, --pad-mla-for-vllm and --tokenizer (give those to the base's export, --lora base)"
        )


def _write_peft(args, info) -> Path:
    """--lora peft: the run's adapters as a PEFT adapter directory at --to-hf."""
    from composer_jax.config import ConfigError
    from composer_jax.hf.checkpoint_kind import detect
    from composer_jax.hf.lora_export import load_lora_run, save_peft_adapter

    run = load_lora_run(run_checkpoints(Path(args.from_run)), info.step, info.run_config, with_base=False)
    base, init_from = "", run.cfg.train.init_from
    try:
        if init_from and detect(init_from).kind == "hf":  # PEFT applies it to that checkpoint as it is
            base = str(Path(init_from).resolve())
    except ConfigError:  # not there (any more): the note below
        pass
    out = save_peft_adapter(run.adapters, run.cfg.model, run.cfg.train.lora, args.to_hf, base_model=base)
    if not base:
        print(
            "note: PEFT applies this adapter to the run's base exported as Hugging Face: composer-jax convert "
            f"--from-run {args.from_run} --to-hf BASE_DIR --lora base",
            file=sys.stderr,
        )
    return out


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
        if params is None:  # --lora peft
            out = _write_peft(args, info)
        elif args.to_hf:
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
    lora = ""
    if args.from_run and ((info.run_config.get("train") or {}).get("lora") or {}).get("rank"):
        what = {"merged": "LoRA adapters merged", "base": "the LoRA run's frozen base", "peft": "a PEFT adapter"}
        lora = f"; {what[args.lora or 'merged']}"
    print(
        f"wrote {out} from {info.kind} checkpoint{step} ({cfg.num_layers} layers, {cfg.num_experts} experts, "
        f"{cfg.num_mtp_layers} MTP, {cfg.param_dtype}{lora})"
    )
    return 0

"""`composer-jax inspect CONFIG [key=value ...]`: parameter counts, FLOPs per token and per-device
memory of a model config on a (possibly hypothetical) mesh, without allocating any parameter.

    composer-jax inspect configs/model/kimi_k2.yaml --mesh configs/mesh/h200x256_ep8.yaml \\
        --batch 256 --seq 4096 --device-memory-gib 140
    composer-jax inspect configs/model/deepseek_v3.yaml mesh.fsdp=64 mesh.expert=8 --json

The mesh is taken from the config (or `--mesh FILE`, a YAML holding only a `mesh:` section, merged
over it, then `key=value` overrides). It need not match the devices of this machine: the device
count is not checked, and an axis of -1 takes `--num-devices` (default: the product of the other
axes, i.e. the -1 axis becomes 1). All figures come from `model/accounting.py`; its docstring states
the counting conventions and formulas, which the text report repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_jax.config import MESH_AXES, Config, ConfigError, config_from_dict, deep_merge, read_yaml, to_dict
from composer_jax.model import accounting
from composer_jax.sharding import ShardingRules

FLOPS_FORMULA = (
    "6 x active matmul params (embedding gather excluded, output head included) "
    "+ 12 x layers x heads x (qk_head_dim + v_head_dim)/2 x S_ctx; "
    "S_ctx = seq/2 (causal attention, headline) or seq (PaLM/Megatron convention)"
)


class UsageError(ValueError):
    """A command-line argument is missing, malformed or out of range."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and sys.exit(2) itself; let main decide
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="composer-jax inspect",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config (a model config such as configs/model/kimi_k2.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. mesh.fsdp=64 model.num_layers=4")
    p.add_argument("--mesh", metavar="FILE", help="YAML holding only a `mesh:` section, merged over the config's")
    p.add_argument(
        "--num-devices",
        type=int,
        metavar="N",
        help="devices for a mesh axis of -1 (default: the product of the other axes)",
    )
    p.add_argument(
        "--batch", type=int, metavar="B", help="global batch in sequences (default: one sequence per batch shard)"
    )
    p.add_argument("--seq", type=int, metavar="S", default=4096, help="sequence length (default 4096)")
    p.add_argument(
        "--device-memory-gib",
        type=float,
        metavar="GIB",
        help="device memory to check the estimate against (an H200 shows ~140 GiB)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    return p


def _load(args: argparse.Namespace) -> Config:
    data = read_yaml(Path(args.config).resolve())
    if args.mesh:
        mesh_data = read_yaml(Path(args.mesh).resolve())
        extra = sorted(set(mesh_data) - {"mesh"})
        if extra or "mesh" not in mesh_data:
            raise ConfigError(
                f"--mesh {args.mesh!r} must hold only a `mesh:` section; found keys "
                f"{sorted(mesh_data)} (accepted: ['mesh'])"
            )
        deep_merge(data, mesh_data)
    # num_devices=None: the mesh may describe a cluster this machine is not part of
    return config_from_dict(data, args.overrides, num_devices=None)


def _mesh_sizes(cfg: Config, num_devices: int | None) -> dict[str, int]:
    fixed = math.prod(getattr(cfg.mesh, a) for a in MESH_AXES if getattr(cfg.mesh, a) != -1)
    if num_devices is not None and num_devices < 1:
        raise UsageError(f"--num-devices {num_devices} must be a positive integer")
    return cfg.mesh.shape(fixed if num_devices is None else num_devices)


def build_report(
    cfg: Config, sizes: dict[str, int], batch: int | None, seq: int, device_memory_gib: float | None = None
) -> dict[str, Any]:
    """Everything `inspect` prints, as a JSON-serialisable dict. Raises UsageError on bad batch/seq."""
    m = cfg.model
    rules = ShardingRules.create(cfg.sharding_rules)
    shards = accounting.batch_shards(rules, sizes)
    if batch is None:
        batch = shards
    if batch < 1 or batch % shards:
        raise UsageError(
            f"--batch {batch}: the batch is split over mesh axes {list(rules.mesh_axes('act_batch'))} "
            f"= {shards} ways; accepted: a positive multiple of {shards}"
        )
    if seq < 1 or seq % sizes["context"]:
        raise UsageError(f"--seq {seq}: must be a positive multiple of mesh.context={sizes['context']}")
    if seq > m.max_position_embeddings:
        raise UsageError(
            f"--seq {seq} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
            f"accepted: 1..{m.max_position_embeddings}"
        )
    rows = accounting.param_rows(m, rules, sizes)
    comps = accounting.breakdown(rows)
    main = {k: v for k, v in comps.items() if k != "mtp"}
    flops = accounting.flops_per_token(m, rows, seq)
    mem = accounting.memory_per_device(m, rows, rules, sizes, batch, seq)
    report = {
        "model": m.name,
        "mesh": sizes,
        "devices": math.prod(sizes.values()),
        "batch": batch,
        "seq": seq,
        "tokens_per_step": batch * seq,
        "params": {
            "total": sum(v["total"] for v in main.values()),
            "active": sum(v["active"] for v in main.values()),
            "mtp_total": comps.get("mtp", {}).get("total", 0),
            "mtp_active": comps.get("mtp", {}).get("active", 0),
            "components": comps,
        },
        "flops_per_token": {**flops, "formula": FLOPS_FORMULA},
        "flops_per_step": flops["total"] * batch * seq,
        "memory_per_device": mem,
        "param_dtype": m.param_dtype,
        "compute_dtype": m.compute_dtype,
        "replicated_params": [
            r.path for r in rows if r.shards == 1 and math.prod(sizes.values()) > 1 and r.size >= 1 << 20
        ],
        "unsplit_axes": [
            {"path": r.path, "logical_axis": la, "mesh_axis": ma, "dim": dim} for r in rows for la, ma, dim in r.unsplit
        ],
    }
    if device_memory_gib is not None:
        report["device_memory_gib"] = device_memory_gib
        report["fits"] = accounting.fits(mem["total"], device_memory_gib)
    return accounting.as_builtin(report)


# --------------------------------------------------------------------------------------------------
# Text rendering
# --------------------------------------------------------------------------------------------------


def _n(x: float) -> str:
    """Human count: 1.03T, 32.9B, 396M, 12.3K."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}" if x / div < 100 else f"{x / div:.0f}{unit}"
    return f"{x:.0f}"


def _gib(x: float) -> str:
    """Bytes in GiB, or MiB / KiB when small (tiny configs)."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20)):
        if x >= div / 10:
            return f"{x / div:.2f} {unit}"
    return f"{x / 2**10:.2f} KiB"


def format_report(r: dict[str, Any]) -> str:
    p, f, mem = r["params"], r["flops_per_token"], r["memory_per_device"]
    act = mem["activations"]
    mesh = " ".join(f"{a}={s}" for a, s in r["mesh"].items())
    lines = [
        f"model {r['model']}  params {r['param_dtype']}  compute {r['compute_dtype']}  remat {act['remat']}",
        f"mesh  {mesh}  ({r['devices']} device{'s' if r['devices'] > 1 else ''})",
        f"batch {r['batch']} x seq {r['seq']} = {r['tokens_per_step']:,} tokens/step, "
        f"{act['tokens_per_device']:,.0f} per device",
        "",
        f"parameters  total {_n(p['total'])} ({p['total']:,})   active/token {_n(p['active'])} ({p['active']:,})",
    ]
    if p["mtp_total"]:
        lines.append(
            f"            MTP modules (excluded above) {_n(p['mtp_total'])} total, {_n(p['mtp_active'])} active"
        )
    lines += ["", f"  {'component':<16}{'total':>12}{'active':>12}{'share':>8}{'per device':>14}"]
    for name, c in p["components"].items():
        share = c["total"] / p["total"] if name != "mtp" else float("nan")
        lines.append(
            f"  {name:<16}{_n(c['total']):>12}{_n(c['active']):>12}"
            f"{share:>8.1%}{_gib(c['bytes_per_device']):>14}".replace("  nan%", "     -")
        )
    lines += [
        "",
        f"training FLOPs/token  {f['total']:.4g}  (matmul {f['matmul']:.4g} + causal attention "
        f"{f['attention_causal']:.4g})",
        f"  full-attention convention {f['total_full_attention']:.4g}; per step {r['flops_per_step']:.4g}"
        + (f"; MTP adds {f['mtp']:.4g}/token" if "mtp" in f else ""),
        f"  = {f['formula']}",
        "",
        "memory per device (estimate)",
        f"  parameters       {_gib(mem['params']):>12}   ({r['param_dtype']}, sharded by the rules)",
        f"  gradients        {_gib(mem['grads']):>12}   (parameter dtype and sharding)",
        f"  AdamW state      {_gib(mem['optimizer']):>12}   (2 x float32 moments"
        + (" + float32 master copy)" if r["param_dtype"] == "bfloat16" else ")"),
        f"  FSDP buffers     {_gib(mem['fsdp_buffers']):>12}   (one layer gathered + its unreduced gradient)",
        f"  activations      {_gib(act['total']):>12}   (layers {_gib(act['layers'])}, logits {_gib(act['logits'])}, "
        f"mask {_gib(act['mask'])}; remat={act['remat']})",
        f"  total            {_gib(mem['total']):>12}",
    ]
    if "fits" in r:
        verdict = "fits" if r["fits"] else "does NOT fit"
        lines.append(f"  {verdict} in {r['device_memory_gib']:g} GiB per device")
    if r["unsplit_axes"]:
        lines += ["", "not split as the rules say (the mesh axis does not divide the dimension; replicated over it):"]
        lines += [
            f"  {u['path']}: {u['logical_axis']} ({u['dim']}) not over {u['mesh_axis']}" for u in r["unsplit_axes"]
        ]
    if r["replicated_params"]:
        lines += [
            "",
            "replicated on every device (>= 1M scalars; no rule maps their axes to a mesh axis > 1):",
            "  " + ", ".join(r["replicated_params"]),
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `composer-jax inspect`; returns 0, or 2 on a bad argument / config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not [a for a in argv if not a.startswith("-")] and not {"-h", "--help"} & set(argv):
            raise UsageError("missing CONFIG: give a YAML config such as configs/model/kimi_k2.yaml")
        args = _parser().parse_intermixed_args(argv)
        cfg = _load(args)
        sizes = _mesh_sizes(cfg, args.num_devices)
        if args.device_memory_gib is not None and args.device_memory_gib <= 0:
            raise UsageError(f"--device-memory-gib {args.device_memory_gib} must be positive")
        report = build_report(cfg, sizes, args.batch, args.seq, args.device_memory_gib)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (UsageError, ConfigError) as e:
        print(f"composer-jax inspect: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        report["config"] = to_dict(cfg)
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

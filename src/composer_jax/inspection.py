"""`composer-jax inspect CONFIG [key=value ...]`: parameter counts, FLOPs per token and per-device
memory of a model or training config on a (possibly hypothetical) mesh, without allocating any
parameter, and a verdict against a device.

    composer-jax inspect configs/pretrain/stage2_256k.yaml          # the stage as it runs, on its H200
    composer-jax inspect configs/model/kimi_k2.yaml --mesh configs/mesh/h200x256_ep8.yaml \\
        --batch 256 --seq 4096 --device h200
    composer-jax inspect configs/model/deepseek_v3.yaml mesh.fsdp=64 mesh.expert=8 --json
    composer-jax inspect configs/pretrain/tiny_stage1.yaml --xla   # next to XLA's own analysis

With `train.lora` (a rank > 0) the estimate is the LoRA run's (the frozen base plus float32
adapters, gradients and AdamW's moments of the adapters alone) and a LoRA section shows the
trainable parameters and AdamW's state full fine-tuning vs with LoRA (`lora_report`).

Also: the expert-parallel all-to-all bytes per device per step of both exchange strategies
(padded, ragged) and their time at NVLink and InfiniBand line rates (`expert_all_to_all`); for an RL
config, its trainer step, vLLM replica and what the run asks Ray for (inspection_rl.py).

The mesh is taken from the config (or `--mesh FILE`, a YAML holding only a `mesh:` section, merged
over it, then `key=value` overrides). It need not match the devices of this machine: the device
count is not checked, and an axis of -1 takes `--num-devices` (default: the product of the other
axes, i.e. the -1 axis becomes 1). A training config (one with a `train:` section) is sized at its
own batch, sequence length and micro-batches, and checked against its `train.device`; flags
override. With a device the exit status is 1 when the estimate does not fit with `--min-headroom`
free, so a launch script can gate on it; bad arguments exit 2. All figures come from
`model/accounting.py`; its docstring states the counting conventions and formulas, which the text
report repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_jax import inspection_rl
from composer_jax.config import (
    MESH_AXES,
    Config,
    ConfigError,
    config_from_layers,
    read_yaml,
    read_yaml_layers,
    to_dict,
)
from composer_jax.config.run import Layer
from composer_jax.errors import UsageError
from composer_jax.hf.init_from import resolve_model_from
from composer_jax.model import accounting
from composer_jax.sharding import MeshRules, ShardingRules

FLOPS_FORMULA = (
    "6 x active matmul params (embedding gather excluded, output head included) "
    "+ 12 x layers x heads x (qk_head_dim + v_head_dim)/2 x S_ctx; "
    "S_ctx = seq/2 (causal attention, headline) or seq (PaLM/Megatron convention)"
)


DEFAULT_SEQ = 4096
DEFAULT_MIN_HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Device:
    """An accelerator's memory as its vendor's data sheet states it (decimal GB = 10^9 bytes)."""

    name: str
    memory_gb: float
    source: str

    @property
    def memory_bytes(self) -> float:
        # Data sheets state decimal GB; the memory a runtime reports is at least that (CUDA shows
        # an H200's "141 GB" as ~140 GiB = 150e9 bytes), so 10^9 bytes per GB is a lower bound.
        return self.memory_gb * 1e9


# per-device memory from the vendors' data sheets (HBM capacity of one GPU / chip)
DEVICES: dict[str, Device] = {
    "a100-80gb": Device("NVIDIA A100 80GB", 80, "NVIDIA A100 data sheet"),
    "h100": Device("NVIDIA H100 SXM", 80, "NVIDIA H100 data sheet"),
    "h200": Device("NVIDIA H200 SXM", 141, "NVIDIA H200 data sheet"),
    "b200": Device("NVIDIA B200", 180, "NVIDIA DGX B200 data sheet (1,440 GB for 8 GPUs)"),
    "tpu-v5e": Device("Google TPU v5e", 16, "Google Cloud TPU v5e documentation"),
    "tpu-v5p": Device("Google TPU v5p", 95, "Google Cloud TPU v5p documentation"),
    "tpu-v6e": Device("Google TPU v6e (Trillium)", 32, "Google Cloud TPU v6e documentation"),
}


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """One GPU's bandwidth in ONE direction over a link, from the vendor's data sheet. An
    all-to-all sends and receives at once, so a device's time is its bytes sent / this figure."""

    name: str
    bytes_per_s: float
    source: str


# NVLink: NVIDIA H200 (and H100 SXM) data sheet, "NVLink: 900GB/s" per GPU, the sum of both
# directions (18 fourth-generation links x 50 GB/s bidirectional), so 450 GB/s each way.
# InfiniBand: NVIDIA DGX H200 data sheet, "8x single-port NVIDIA ConnectX-7 VPI, up to 400Gb/s
# InfiniBand/Ethernet" (one NDR port per GPU; ConnectX-7 data sheet: 400 Gb/s per port), 400 Gb/s =
# 50 GB/s each way. Both are line rates: the all-to-all attains less (protocol overhead, congestion,
# latency of small messages), so the times below are lower bounds.
INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink": Interconnect(
        "NVLink 4 (H100/H200 SXM)", 450e9, "NVIDIA H200 data sheet: NVLink 900 GB/s per GPU, both ways"
    ),
    "infiniband": Interconnect(
        "InfiniBand NDR (one 400 Gb/s ConnectX-7 per GPU)",
        50e9,
        "NVIDIA DGX H200 data sheet: 8x single-port ConnectX-7, 400 Gb/s InfiniBand",
    ),
}
GPUS_PER_NODE = 8  # HGX / DGX H100, H200, B200: the NVLink domain of the meshes' plain device order


def expert_all_to_all(cfg: Config, sizes: dict[str, int], tokens_per_device: float, micro_batches: int) -> dict:
    """All-to-all bytes per device per training step of the expert-parallel exchange, for both
    strategies (`model/moe/expert_parallel.py`): the hidden-vector rows (`exchange_traffic` per layer
    and exchange x `exchanges_per_step` x MoE layers (MTP included) x micro-batches) and the int32
    metadata (padded: expert ids with the dispatch; ragged: the counts all_gather; once per forward
    pass), with the time at each `INTERCONNECTS` line rate and the link the mesh's expert axis uses
    (make_mesh's plain device order: an expert group whose devices lie within one node of
    GPUS_PER_NODE uses NVLink, otherwise InfiniBand)."""
    from composer_jax.model.moe import expert_parallel as xp

    m = cfg.model
    ep = sizes["expert"]
    layers = (m.num_moe_layers + m.num_mtp_layers) if m.num_experts else 0
    itemsize = 2 if m.compute_dtype == "bfloat16" else 4
    exchanges = xp.exchanges_per_step(m.remat)
    forward_passes = 1 + (m.remat != "none")
    per_layer = xp.exchange_traffic(
        m.hidden_size,
        itemsize,
        m.num_experts or 1,
        m.num_experts_per_tok,
        ep,
        int(tokens_per_device),
        m.moe_ep_capacity_factor,
    )
    stride = math.prod(sizes[a] for a in MESH_AXES[MESH_AXES.index("expert") + 1 :])
    span = stride * (ep - 1) + 1  # devices from the first to the last of one expert group
    link = "nvlink" if span <= GPUS_PER_NODE else "infiniband"
    out: dict[str, Any] = {
        "ep": ep,
        "moe_layers": layers,
        "exchanges_per_layer": exchanges,
        "micro_batches": micro_batches,
        "tokens_per_device": tokens_per_device,
        "expert_axis_stride": stride,
        "link": link,
        "gpus_per_node": GPUS_PER_NODE,
        "capacity_factor": m.moe_ep_capacity_factor,
        "exchange_on_gpu": "ragged" if m.moe_ep_exchange == "auto" else xp.ep_exchange(m),
        "interconnects": {k: dataclasses.asdict(v) for k, v in INTERCONNECTS.items()},
        "strategies": {},
    }
    for name, t in per_layer.items():
        rows = t["bytes"] * exchanges * layers * micro_batches if ep > 1 and layers else 0
        meta = t["metadata_bytes"] * forward_passes * layers * micro_batches if ep > 1 and layers else 0
        total = rows + meta
        out["strategies"][name] = {
            "row_bytes": rows,
            "metadata_bytes": meta,
            "bytes": total,
            "bytes_per_layer_exchange": t["bytes"],
            "receive_rows": t["receive_rows"],
            "seconds": {k: total / v.bytes_per_s for k, v in INTERCONNECTS.items()},
        }
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and sys.exit(2) itself; composer-jax's dispatcher does
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
        "--batch",
        type=int,
        metavar="B",
        help="global batch in sequences (default: the config's train.batch_size; for a model config "
        "without a train section, one sequence per batch shard)",
    )
    p.add_argument(
        "--seq",
        type=int,
        metavar="S",
        help=f"sequence length (default: the config's train.seq_len, else {DEFAULT_SEQ})",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        metavar="M",
        help="gradient-accumulation micro-batches (default: the config's train.micro_batches, else 1)",
    )
    dev = p.add_mutually_exclusive_group()
    dev.add_argument(
        "--device",
        metavar="NAME",
        help=f"device to check the estimate against, from the vendors' data sheets: {', '.join(DEVICES)}",
    )
    dev.add_argument("--device-memory-gib", type=float, metavar="GIB", help="device memory to check against, in GiB")
    p.add_argument(
        "--min-headroom",
        type=float,
        metavar="FRAC",
        default=DEFAULT_MIN_HEADROOM,
        help=f"share of device memory that must stay free for a 'fits' verdict (default {DEFAULT_MIN_HEADROOM})",
    )
    p.add_argument(
        "--fp32-master",
        action="store_true",
        help="size the optimiser as float32 moments + a float32 master copy of bfloat16 parameters "
        "(16 bytes per parameter with weights and gradients) instead of what train/optimizer.py keeps "
        "(moments in the parameter dtype)",
    )
    p.add_argument(
        "--xla",
        action="store_true",
        help="also compile the real train step on this machine's devices (the mesh must match them) and "
        "print XLA's per-device memory analysis next to the estimate",
    )
    p.add_argument(
        "--serve-precision",
        choices=inspection_rl.SERVE_PRECISIONS,
        help="an RL config's vLLM replica: the weights' serving precision (default: rl.vllm.quantization or "
        "rl.vllm.dtype with rl.sampler_engine vllm, else rl.publish_dtype, else model.param_dtype; fp8 = vLLM "
        "--quantization fp8, block-scaled as the DeepSeek / Kimi hub checkpoints)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="U",
        default=inspection_rl.DEFAULT_GPU_MEMORY_UTILIZATION,
        help="an RL config's vLLM replica: share of each GPU's memory vLLM may use "
        f"(its --gpu-memory-utilization; default {inspection_rl.DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    return p


def _load(args: argparse.Namespace) -> tuple[Config, bool]:
    """The config, and whether it is a training config (its YAML, with bases, has a `train:` section).
    Sets args.rl when the YAML has an `rl:` section (an RL run: the trainer step and replica are sized)."""
    layers: list[Layer] = list(read_yaml_layers(Path(args.config).resolve()))
    data = read_yaml(Path(args.config).resolve())
    is_training = "train" in data
    args.rl = "rl" in data
    if args.mesh:
        mesh_data = read_yaml(Path(args.mesh).resolve())
        extra = sorted(set(mesh_data) - {"mesh"})
        if extra or "mesh" not in mesh_data:
            raise ConfigError(
                f"--mesh {args.mesh!r} must hold only a `mesh:` section; found keys "
                f"{sorted(mesh_data)} (accepted: ['mesh'])"
            )
        layers.append((args.mesh, mesh_data))
    # num_devices=None: the mesh may describe a cluster this machine is not part of
    cfg = resolve_model_from(config_from_layers(layers, args.overrides, num_devices=None), num_devices=None)
    return cfg, is_training or any(o.startswith("train.") for o in args.overrides)


def _mesh_sizes(cfg: Config, num_devices: int | None) -> dict[str, int]:
    fixed = math.prod(getattr(cfg.mesh, a) for a in MESH_AXES if getattr(cfg.mesh, a) != -1)
    if num_devices is not None and num_devices < 1:
        raise UsageError(f"--num-devices {num_devices} must be a positive integer")
    return cfg.mesh.shape(fixed if num_devices is None else num_devices)


def _ce_chunks(batch: int, seq: int, rules: ShardingRules, sizes: dict[str, int]) -> int:
    """`train.pretrain.ce_chunks` (the fused loss's sequence chunks) for a micro-batch of this shape."""
    from composer_jax.train.pretrain import ce_chunks

    return ce_chunks((batch, seq), MeshRules(accounting.abstract_mesh(sizes), rules))


def _checked_shape(
    cfg: Config, rules: ShardingRules, sizes: dict[str, int], batch: int | None, seq: int, micro_batches: int
) -> int:
    """The batch (default: one row per batch shard and micro-batch), checked with the sequence
    against the mesh and the model; UsageError names the bad value and what is accepted."""
    m = cfg.model
    shards = accounting.batch_shards(rules, sizes)
    if micro_batches < 1:
        raise UsageError(f"--micro-batches {micro_batches}: accepted: a positive integer")
    if batch is None:
        batch = shards * micro_batches
    if batch < 1 or batch % (shards * micro_batches):
        raise UsageError(
            f"batch {batch} (--batch or train.batch_size): each of the {micro_batches} micro-batch(es) "
            f"is split over mesh axes {list(rules.mapped_axes('act_batch'))} = {shards} ways; "
            f"accepted: a positive multiple of {shards * micro_batches}"
        )
    cp = sizes["context"]
    if seq < 1 or (cp > 1 and seq % (2 * cp)):
        raise UsageError(
            f"--seq {seq}: must be a positive multiple of 2 x mesh.context = {2 * cp} (zigzag layout)"
            if cp > 1
            else f"--seq {seq}: accepted: a positive integer"
        )
    if seq > m.max_position_embeddings:
        raise UsageError(
            f"--seq {seq} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
            f"accepted: 1..{m.max_position_embeddings}"
        )
    return batch


def _base_report(
    cfg: Config,
    sizes: dict[str, int],
    batch: int,
    seq: int,
    micro_batches: int,
    fp32_master: bool,
    rows: list[accounting.ParamRow],
    comps: dict[str, Any],
    flops: dict[str, Any],
    mem: dict[str, Any],
) -> dict[str, Any]:
    """`build_report`'s figures of the model, its mesh and its step (no verdict, LoRA or RL)."""
    m = cfg.model
    main = {k: v for k, v in comps.items() if k != "mtp"}
    return {
        "model": m.name,
        "mesh": sizes,
        "devices": math.prod(sizes.values()),
        "batch": batch,
        "seq": seq,
        "micro_batches": micro_batches,
        "fp32_master": fp32_master,
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
        "expert_all_to_all": expert_all_to_all(cfg, sizes, mem["activations"]["tokens_per_device"], micro_batches),
    }


def build_report(
    cfg: Config,
    sizes: dict[str, int],
    batch: int | None,
    seq: int,
    device_memory_gib: float | None = None,
    *,
    micro_batches: int = 1,
    device: str | None = None,
    min_headroom: float = DEFAULT_MIN_HEADROOM,
    fp32_master: bool = False,
    backend: str = "gpu",
    rl: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything `inspect` prints, as a JSON-serialisable dict. Raises UsageError on bad batch/seq.

    `device` (a key of DEVICES) or `device_memory_gib` adds a verdict: the estimate fits when it
    leaves at least `min_headroom` of the device's memory free. `backend` is where the step will run
    ("cpu" for XLA:CPU, anything else an accelerator): `model.moe_impl=auto` takes the tiled
    dispatch on CPU and ragged_dot elsewhere, and the tiled one costs more memory. `rl` (an RL
    config: serve_precision, utilization) adds the RL trainer step and vLLM replica (inspection_rl.py)."""
    m = cfg.model
    rules = ShardingRules.create(cfg.sharding_rules)
    batch = _checked_shape(cfg, rules, sizes, batch, seq, micro_batches)
    if not 0 <= min_headroom < 1:
        raise UsageError(f"--min-headroom {min_headroom}: accepted: a fraction in [0, 1)")
    if device is not None and device not in DEVICES:
        raise UsageError(f"device {device!r} (--device or train.device) is not known; accepted: {', '.join(DEVICES)}")
    rows = accounting.param_rows(m, rules, sizes)
    comps = accounting.breakdown(rows)
    flops = accounting.flops_per_token(m, rows, seq)
    # the loss as train/pretrain.py computes it: the fused head + cross-entropy in sequence chunks,
    # unless MTP self-distillation needs the main model's whole logits
    self_distill = bool(m.num_mtp_layers) and cfg.train.mtp_loss == "self_distill"
    head_chunks = None if self_distill else _ce_chunks(batch // micro_batches, seq, rules, sizes)
    # a quantised frozen base runs remat none as dots (model/transformer.py `_remat`)
    lc = cfg.train.lora
    quantised = lc.enabled and lc.base_format != "none" and m.remat == "none"
    mem = accounting.memory_per_device(
        dataclasses.replace(m, remat="dots") if quantised else m,
        rows,
        rules,
        sizes,
        batch,
        seq,
        micro_batches,
        fp32_master=fp32_master,
        head_chunks=head_chunks,
        self_distill=self_distill,
        tiled_moe=m.moe_impl == "tiled" or (m.moe_impl == "auto" and backend == "cpu"),
    )
    lora = lora_report(cfg, rows, rules, sizes, mem, micro_batches, fp32_master) if cfg.train.lora.enabled else None
    report = _base_report(cfg, sizes, batch, seq, micro_batches, fp32_master, rows, comps, flops, mem)
    if lora is not None:
        report["lora"] = lora
    if device is not None or device_memory_gib is not None:
        report.update(_verdict(mem["total"], device, device_memory_gib, min_headroom))
    if rl is not None:
        capacity = report["device"]["memory_bytes"] if "device" in report else None
        report["rl"] = inspection_rl.rl_report(
            cfg,
            report,
            rows,
            rules,
            sizes,
            head_chunks,
            device_bytes=capacity,
            accelerator=_accelerator(device, device_memory_gib),
            min_headroom=min_headroom,
            **rl,
        )
    return accounting.as_builtin(report)


def _optimizer_bytes(rows: list[accounting.ParamRow], fp32_master: bool) -> int:
    """AdamW's state of the whole of `rows` (not per device), as `accounting.memory_per_device`
    counts it per device: two moments in each array's dtype, or with `fp32_master` two float32
    moments plus a float32 copy of each bfloat16 array."""
    if fp32_master:
        return sum(r.size * (8 + (4 if r.dtype == "bfloat16" else 0)) for r in rows)
    return 2 * sum(r.bytes for r in rows)


def lora_report(
    cfg: Config,
    rows: list[accounting.ParamRow],
    rules: ShardingRules,
    sizes: dict[str, int],
    mem: dict[str, Any],
    micro_batches: int,
    fp32_master: bool,
) -> dict[str, Any]:
    """`train.lora`: the trainable parameters (the adapters, float32) against the model's, and
    AdamW's state full fine-tuning vs over the adapters alone, whole and per device. Rewrites `mem`
    (full fine-tuning's estimate) to the LoRA run's: parameters = the frozen base + the adapters,
    gradients and AdamW's moments of the adapters only (float32 already: `fp32_master` changes
    nothing for them); the FSDP buffers keep the base layers' gathered weights and are left as
    counted (their unreduced-gradient half is not formed for the base: an upper bound). With
    `train.lora.base_format` the base's parameters are its stored bytes (codes + scales of the
    layers' linear kernels, `accounting.frozen_base_bytes`); the gathered (FSDP) weights stay
    counted in the parameter dtype (the layer dequantises them: an upper bound again)."""
    lc = cfg.train.lora
    ad = accounting.adapter_rows(cfg.model, lc, rules, sizes)
    base = accounting.frozen_base_bytes(cfg.model, lc.base_format, rules, sizes)
    adapters_pd = sum(r.bytes_per_device for r in ad)
    full_pd = mem["optimizer"]
    lora_pd = 2 * adapters_pd
    total, trainable = sum(r.size for r in rows), sum(r.size for r in ad)
    full, with_lora = _optimizer_bytes(rows, fp32_master), 2 * sum(r.bytes for r in ad)
    mem["params"] += base["bytes_per_device"] - sum(r.bytes_per_device for r in rows) + adapters_pd
    mem["grads"] = adapters_pd * (2 if micro_batches > 1 else 1)
    mem["optimizer"] = lora_pd
    mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + mem["fsdp_buffers"] + mem["activations"]["total"]
    return {
        "rank": lc.rank,
        "alpha": lc.alpha,
        "targets": list(lc.targets),
        "model_params": total,  # every parameter of the model, MTP modules included: the frozen base
        "trainable_params": trainable,
        "trainable_fraction": trainable / total,
        "adapter_bytes": sum(r.bytes for r in ad),
        "optimizer_bytes": {"full": full, "lora": with_lora},
        "optimizer_bytes_per_device": {"full": full_pd, "lora": lora_pd},
        "optimizer_saving": full / with_lora,
        "base_format": lc.base_format,
        # the frozen base as stored: every array (codes + scales of the quantised kernels, the rest
        # as it is), whole and per device; the quantised kernels' stored vs parameter-dtype bytes
        "base_bytes": base["bytes"],
        "base_bytes_per_device": base["bytes_per_device"],
        "base_float_bytes": sum(r.bytes for r in rows),
        "quantised_bytes": {"stored": base["quantised_bytes"], "float": base["quantised_float_bytes"]},
    }


def _lora_lines(x: dict[str, Any]) -> list[str]:
    opt, pd = x["optimizer_bytes"], x["optimizer_bytes_per_device"]
    return [
        "",
        f"LoRA (train.lora: rank {x['rank']}, alpha {x['alpha']:g}, targets {', '.join(x['targets'])}; the memory "
        "above is the LoRA run's)",
        f"  trainable   {_n(x['trainable_params'])} ({x['trainable_params']:,}) adapter parameters (float32) over "
        f"{_n(x['model_params'])} ({x['model_params']:,}) frozen: {x['trainable_fraction']:.3%} of the model's",
        f"  AdamW state {opt['full']:,} B full fine-tuning vs {opt['lora']:,} B with LoRA "
        f"({x['optimizer_saving']:.1f}x less); per device {_gib(pd['full'])} vs {_gib(pd['lora'])}",
        f"  a checkpoint's parameters and a publish to the weight store: the adapters, {x['adapter_bytes']:,} B",
        *_base_lines(x),
    ]


def _base_lines(x: dict[str, Any]) -> list[str]:
    """The frozen base's stored bytes (train.lora.base_format)."""
    if x["base_format"] == "none":
        return [f"  frozen base {x['base_bytes']:,} B as loaded (train.lora.base_format none)"]
    q = x["quantised_bytes"]
    return [
        f"  frozen base {x['base_bytes']:,} B stored ({x['base_format']}; {x['base_float_bytes']:,} B in the "
        f"parameter dtype, {x['base_float_bytes'] / x['base_bytes']:.2f}x less); per device "
        f"{_gib(x['base_bytes_per_device'])}",
        f"    the layers' linear kernels: {q['stored']:,} B of codes + scales for {q['float']:,} B "
        f"({q['stored'] / q['float']:.3f} of it); norms, router, embedding and head as they are",
    ]


def _accelerator(device: str | None, device_memory_gib: float | None) -> str:
    """What the trainer's devices are (inspection_rl.ACCELERATORS): a TPU of DEVICES, a GPU (any other
    device named, or a memory given), else CPU devices (a run sized for no device)."""
    if device is not None:
        return "tpu" if device.startswith("tpu") else "gpu"
    return "gpu" if device_memory_gib is not None else "cpu"


def _verdict(total: float, device: str | None, device_memory_gib: float | None, min_headroom: float) -> dict[str, Any]:
    """The report's device fields: the device's memory, the headroom the estimate `total` leaves
    and whether it fits (at least `min_headroom` of the device free)."""
    report: dict[str, Any] = {}
    if device is not None:
        dev = DEVICES[device]
        capacity, label = dev.memory_bytes, f"{dev.name}, {dev.memory_gb:g} GB"
    else:
        assert device_memory_gib is not None
        if device_memory_gib <= 0:
            raise UsageError(f"--device-memory-gib {device_memory_gib} must be positive")
        capacity, label = device_memory_gib * 2**30, f"{device_memory_gib:g} GiB"
    headroom = capacity - total
    report["device"] = {"name": device, "label": label, "memory_bytes": capacity}
    report["device_memory_gib"] = capacity / 2**30
    report["headroom_bytes"] = headroom
    report["headroom_fraction"] = headroom / capacity
    report["min_headroom"] = min_headroom
    report["fits"] = headroom >= min_headroom * capacity
    return report


def _backend() -> str:
    import jax

    return jax.default_backend()


def _with_shape(cfg: Config, report: dict[str, Any]) -> Config:
    """`cfg` with the batch, sequence and micro-batches the report was made for."""
    train = dataclasses.replace(
        cfg.train, batch_size=report["batch"], seq_len=report["seq"], micro_batches=report["micro_batches"]
    )
    return dataclasses.replace(cfg, train=train)


def xla_memory(cfg: Config) -> dict[str, int]:
    """XLA's own per-device memory analysis of the real train step (`train.step.make_train_step`,
    state donated) for `cfg` on this machine's devices: compiled, never run.

    `compiled.memory_analysis()` of an SPMD program describes one device's program:
      argument: the inputs' bytes on one device: the train state's shards (parameters, AdamW
                moments, step count, RNG) plus the batch's shard;
      output:   the new state's shards plus the metrics;
      alias:    output bytes that reuse (donated) argument buffers: the whole new state;
      temp:     every buffer live at some point that is neither argument nor output (gradients,
                activations, gathered weights, collective buffers, optimiser temporaries), packed
                by XLA's buffer assignment, so their peak and not their sum.
    The peak per device is argument + output - alias + temp (`total`).
    """
    import jax

    from composer_jax import specs
    from composer_jax.sharding import make_mesh
    from composer_jax.train.state import abstract_train_state
    from composer_jax.train.step import BATCH_KEYS, batch_specs, make_train_step

    have = jax.device_count()
    try:
        cfg.mesh.shape(have)
    except ConfigError as e:
        raise UsageError(
            f"--xla compiles the step on this machine's {have} {jax.default_backend()} device(s), which the "
            f"mesh does not fit: {e}. On CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices"
        ) from None
    rules = ShardingRules.create(cfg.sharding_rules)
    mesh = make_mesh(cfg.mesh)
    batch = specs.abstract(batch_specs(cfg, BATCH_KEYS), "int32", mesh, rules)
    state = abstract_train_state(cfg, mesh, rules)
    ma = make_train_step(cfg, mesh, rules).lower(state, batch).compile().memory_analysis()
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def xla_comparison(cfg: Config, mem: dict[str, Any]) -> dict[str, Any]:
    """XLA's figures (`xla_memory`) next to the estimate: state (parameters + optimiser, against
    XLA's arguments), working set (gradients + FSDP buffers + activations, against XLA's temp) and
    the total, each as estimate / XLA."""
    x = xla_memory(cfg)
    state = mem["params"] + mem["optimizer"]
    work = mem["grads"] + mem["fsdp_buffers"] + mem["activations"]["total"]
    return {
        **x,
        "estimate_state": state,
        "estimate_working": work,
        "estimate_total": mem["total"],
        "ratio_state": state / x["argument"],
        "ratio_working": work / max(x["temp"], 1),
        "ratio_total": mem["total"] / x["total"],
    }


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


def _device_lines(r: dict[str, Any]) -> list[str]:
    """The verdict of a report made for a device."""
    mem = r["memory_per_device"]
    d = r["device"]
    verdict = "FITS" if r["fits"] else "DOES NOT FIT"
    free = r["headroom_bytes"]
    free_s = _gib(free) if free >= 0 else "-" + _gib(-free)
    return [
        f"  device           {_gib(d['memory_bytes']):>12}   ({d['label']})",
        f"  headroom         {free_s:>12}"
        f"   ({r['headroom_fraction']:.1%} of the device; at least {r['min_headroom']:.0%} required)",
        f"  verdict: {verdict} ({_gib(mem['total'])} of {_gib(d['memory_bytes'])} per device)",
    ]


def _xla_lines(x: dict[str, Any]) -> list[str]:
    """XLA's memory analysis beside the estimate."""
    return [
        "",
        "XLA memory analysis of the compiled train step (this machine, per device)",
        f"  arguments        {_gib(x['argument']):>12}   estimate state {_gib(x['estimate_state'])} "
        f"({x['ratio_state']:.2f}x)",
        f"  temporaries      {_gib(x['temp']):>12}   estimate working set {_gib(x['estimate_working'])} "
        f"({x['ratio_working']:.2f}x)",
        f"  output - alias   {_gib(x['output'] - x['alias']):>12}",
        f"  total            {_gib(x['total']):>12}   estimate {_gib(x['estimate_total'])} ({x['ratio_total']:.2f}x)",
    ]


def _all_to_all_lines(x2: dict[str, Any]) -> list[str]:
    """The expert all-to-all's bytes and times per step (expert parallelism only)."""
    if not (x2["ep"] > 1 and x2["moe_layers"]):
        return []
    st = x2["strategies"]
    links = x2["interconnects"]
    lines = [
        "",
        f"expert all-to-all per device per step (EP {x2['ep']}; {x2['moe_layers']} MoE layers x "
        f"{x2['micro_batches']} micro-batch(es) x {x2['exchanges_per_layer']} exchanges: dispatch and combine, "
        "forward, backward" + (", remat recompute)" if x2["exchanges_per_layer"] == 6 else ")"),
    ]
    for name, label in (
        ("padded", "padded (all_to_all, [ep, tokens*k] slots)"),
        ("ragged", "ragged (real rows only)"),
    ):
        v = st[name]
        times = ", ".join(f"{v['seconds'][k]:.3g} s at {links[k]['bytes_per_s'] / 1e9:g} GB/s {k}" for k in links)
        lines.append(f"  {label:<42}{_gib(v['bytes']):>12}   ({times})")
    ratio = st["padded"]["bytes"] / max(st["ragged"]["bytes"], 1)
    lines += [
        f"  padded / ragged {ratio:.2f}x; ragged rows at uniform routing ((ep-1)/ep of the assignments leave the "
        f"device); receive buffer {st['ragged']['receive_rows']:,} rows (capacity factor "
        f"{x2['capacity_factor']:g}; 0 = worst case) vs padded {st['padded']['receive_rows']:,}",
        f"  expert groups span devices {x2['expert_axis_stride']} apart: "
        + (
            f"inside a node of {x2['gpus_per_node']} GPUs (NVLink)"
            if x2["link"] == "nvlink"
            else f"across nodes of {x2['gpus_per_node']} GPUs (InfiniBand sets the time)"
        )
        + f"; vendors' line rates (lower bounds); on GPU the step runs {x2['exchange_on_gpu']}",
    ]
    return lines


def format_report(r: dict[str, Any]) -> str:
    p, f, mem = r["params"], r["flops_per_token"], r["memory_per_device"]
    act = mem["activations"]
    mesh = " ".join(f"{a}={s}" for a, s in r["mesh"].items())
    lines = [
        f"model {r['model']}  params {r['param_dtype']}  compute {r['compute_dtype']}  remat {act['remat']}",
        f"mesh  {mesh}  ({r['devices']} device{'s' if r['devices'] > 1 else ''})",
        f"batch {r['batch']} x seq {r['seq']} = {r['tokens_per_step']:,} tokens/step, "
        f"{r['micro_batches']} micro-batch{'es' if r['micro_batches'] > 1 else ''} of "
        f"{act['tokens_per_device']:,.0f} tokens per device",
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
        f"  parameters       {_gib(mem['params']):>12}   ({r['param_dtype']}, sharded by the rules"
        + ("; the frozen base + the float32 adapters)" if "lora" in r else ")"),
        f"  gradients        {_gib(mem['grads']):>12}   "
        + ("(of the LoRA adapters alone" if "lora" in r else "(parameter dtype and sharding")
        + ("; accumulator + one micro-batch's)" if r["micro_batches"] > 1 else ")"),
        f"  AdamW state      {_gib(mem['optimizer']):>12}   "
        + (
            "(2 float32 moments of the LoRA adapters alone)"
            if "lora" in r
            else "(2 x float32 moments + float32 master copy of bfloat16 weights)"
            if r["fp32_master"]
            else "(2 moments in the parameter dtype, as train/optimizer.py keeps them)"
        ),
        f"  FSDP buffers     {_gib(mem['fsdp_buffers']):>12}   (one layer, the output head and the embedding "
        "gathered, with unreduced gradients)",
        f"  activations      {_gib(act['total']):>12}   (layers {_gib(act['layers'])}, logits {_gib(act['logits'])}, "
        f"mask {_gib(act['mask'])}; remat={act['remat']})",
        f"  total            {_gib(mem['total']):>12}",
    ]
    if "lora" in r:
        lines += _lora_lines(r["lora"])
    if "fits" in r:
        lines += _device_lines(r)
    if "xla" in r:
        lines += _xla_lines(r["xla"])
    lines += _all_to_all_lines(r["expert_all_to_all"])
    if "rl" in r:
        lines += inspection_rl.format_rl(r["rl"], _gib)
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
    """Entry point of `composer-jax inspect`: 0, 1 when a device is given and the estimate does not
    fit it (so a launch script can gate on it), 2 on a bad argument / config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not [a for a in argv if not a.startswith("-")] and not {"-h", "--help"} & set(argv):
            raise UsageError("missing CONFIG: give a YAML config such as configs/model/kimi_k2.yaml")
        args = _parser().parse_intermixed_args(argv)
        cfg, is_training = _load(args)
        if args.xla and args.num_devices is None and -1 in [getattr(cfg.mesh, a) for a in MESH_AXES]:
            import jax

            args.num_devices = jax.device_count()  # a -1 axis takes this machine's devices
        sizes = _mesh_sizes(cfg, args.num_devices)
        if args.device is None and args.device_memory_gib is None and is_training and cfg.train.device:
            args.device = cfg.train.device  # the hardware the stage names
        if args.device is not None:
            args.device = args.device.lower()
        t = cfg.train
        report = build_report(
            cfg,
            sizes,
            args.batch if args.batch is not None else t.batch_size if is_training else None,
            args.seq if args.seq is not None else t.seq_len if is_training else DEFAULT_SEQ,
            args.device_memory_gib,
            micro_batches=(
                args.micro_batches if args.micro_batches is not None else t.micro_batches if is_training else 1
            ),
            device=args.device,
            min_headroom=args.min_headroom,
            fp32_master=args.fp32_master,
            backend=_backend() if args.xla else "gpu",
            rl=_rl_args(cfg, args) if args.rl else None,
        )
        if args.xla:
            report["xla"] = xla_comparison(_with_shape(cfg, report), report["memory_per_device"])
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except ConfigError as e:
        raise UsageError(str(e)) from e
    if args.json:
        report["config"] = to_dict(cfg)
        print(json.dumps(accounting.as_builtin(report), indent=1))
    else:
        print(format_report(report))
    return 1 if report.get("fits") is False or report.get("rl", {}).get("trainer_fits") is False else 0


def _rl_args(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """The replica's settings from the flags: the serving precision (default: the published dtype)
    and vLLM's memory utilisation, checked."""
    u = args.gpu_memory_utilization
    if not 0 < u <= 1:
        raise UsageError(f"--gpu-memory-utilization {u}: accepted: a fraction in (0, 1]")
    v = cfg.rl.vllm
    engine = (v.quantization or v.dtype) if cfg.rl.sampler_engine == "vllm" else ""
    precision = args.serve_precision or engine or cfg.rl.publish_dtype or cfg.model.param_dtype
    if precision not in inspection_rl.SERVE_PRECISIONS:
        raise UsageError(
            f"serving precision {precision!r} (from rl.publish_dtype / model.param_dtype) is not accepted; "
            f"give --serve-precision, one of {', '.join(inspection_rl.SERVE_PRECISIONS)}"
        )
    return {"serve_precision": precision, "utilization": u}

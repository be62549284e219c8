"""Hugging Face safetensors checkpoints <-> composer_jax parameters.

    cfg, params = from_pretrained("hf_dir", mesh)      # config.json + *.safetensors -> sharded params
    save_pretrained(params, cfg, "out_dir")              # back to the HF hub layout

Layout differences (ours <- HF), per layer `model.layers.{i}.`:
  - matrices are [in, out] (nn.Linear stores [out, in]);
  - attention projections are per head: q/q_b/kv_b [in, heads, head_dim] <- [heads*head_dim, in],
    o [heads, head_dim, embed] <- [embed, heads*head_dim];
  - experts are stacked [experts, embed, f] / [experts, f, embed] <- `mlp.experts.{e}.{gate,up,down}_proj`
    (hub layout) or the fused `mlp.experts.gate_up_proj` [E, 2f, embed] / `down_proj` [E, embed, f]
    that transformers 5 keeps in memory;
  - layers are stacked: HF layers [0, first_k_dense) -> params["dense_layers"], the rest ->
    params["moe_layers"], DeepSeek MTP modules `model.layers.{num_hidden_layers + k}` -> params["mtp"].
Loading never holds more than one device shard of one parameter on the host: tensors are memory-mapped
and each shard is assembled from the per-layer (per-expert) slices it covers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import Mesh

from composer_jax.checkpoint.validate import CheckpointError
from composer_jax.config import ConfigError, ModelConfig
from composer_jax.hf import safetensors_io as st
from composer_jax.hf.config import HFInfo, family_for, hf_config_from_model, model_config_from_hf
from composer_jax.model.params import param_shardings, param_specs
from composer_jax.sharding import ShardingRules
from composer_jax.specs import ParamSpec

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Layouts: how one HF tensor is viewed in our layout (numpy views, so memory-mapped data stays lazy)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """kind: "copy"; "T" ([out, in] -> [in, out]); "heads_in" ([h*k, in] -> [in, h, k]);
    "heads_out" ([out, h*k] -> [h, k, out]). heads: h for the per-head layouts."""

    kind: str
    heads: int = 0

    def to_ours(self, a: np.ndarray) -> np.ndarray:
        if self.kind == "copy":
            return a
        if self.kind == "T":
            return a.T
        if self.kind == "heads_in":
            return rearrange(a, "(h k) i -> i h k", h=self.heads)
        return rearrange(a, "o (h k) -> h k o", h=self.heads)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        if self.kind == "copy":
            return a
        if self.kind == "T":
            return a.T
        if self.kind == "heads_in":
            return rearrange(a, "i h k -> (h k) i")
        return rearrange(a, "h k o -> o (h k)")

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "copy":
            return ours
        if self.kind == "T":
            return ours[::-1]
        if self.kind == "heads_in":
            return (ours[1] * ours[2], ours[0])
        return (ours[2], ours[0] * ours[1])


COPY, T = Layout("copy"), Layout("T")
EXPERT = "expert"  # marker: routed expert weights (per-expert or fused tensors)
ZEROS = "zeros"  # marker: a parameter the HF family does not have (router bias outside deepseek_v3)


def layer_map_of(cfg: ModelConfig, family: str, moe: bool) -> dict[tuple[str, ...], Any]:
    """Path inside one decoder layer's params -> (HF name suffix, Layout) or a marker."""
    h = cfg.num_heads
    m: dict[tuple[str, ...], Any] = {
        ("attn_norm",): ("input_layernorm.weight", COPY),
        ("mlp_norm",): ("post_attention_layernorm.weight", COPY),
    }
    a = "self_attn."
    if cfg.attention_type == "gqa":
        m[("attn", "q")] = (a + "q_proj.weight", Layout("heads_in", h))
        m[("attn", "k")] = (a + "k_proj.weight", Layout("heads_in", cfg.num_kv_heads))
        m[("attn", "v")] = (a + "v_proj.weight", Layout("heads_in", cfg.num_kv_heads))
        m[("attn", "o")] = (a + "o_proj.weight", Layout("heads_out", h))
        if cfg.qk_norm:
            m[("attn", "q_norm")] = (a + "q_norm.weight", COPY)
            m[("attn", "k_norm")] = (a + "k_norm.weight", COPY)
    else:
        if cfg.q_lora_rank:
            m[("attn", "q_a")] = (a + "q_a_proj.weight", T)
            m[("attn", "q_a_norm")] = (a + "q_a_layernorm.weight", COPY)
            m[("attn", "q_b")] = (a + "q_b_proj.weight", Layout("heads_in", h))
        else:
            m[("attn", "q")] = (a + "q_proj.weight", Layout("heads_in", h))
        m[("attn", "kv_a")] = (a + "kv_a_proj_with_mqa.weight", T)
        m[("attn", "kv_a_norm")] = (a + "kv_a_layernorm.weight", COPY)
        m[("attn", "kv_b")] = (a + "kv_b_proj.weight", Layout("heads_in", h))
        m[("attn", "o")] = (a + "o_proj.weight", Layout("heads_out", h))
    if moe:
        m[("moe", "router")] = ("mlp.gate.weight", T)
        m[("moe", "router_bias")] = ("mlp.gate.e_score_correction_bias", COPY) if family == "deepseek_v3" else ZEROS
        for k in ("gate", "up", "down"):
            m[("moe", k)] = EXPERT
        if cfg.num_shared_experts:
            for k in ("gate", "up", "down"):
                m[("moe", "shared_" + k)] = (f"mlp.shared_experts.{k}_proj.weight", T)
    else:
        for k in ("gate", "up", "down"):
            m[("mlp", k)] = (f"mlp.{k}_proj.weight", T)
    return m


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """One parameter of ours: its path, spec, and where each of its per-layer slices lives in HF.

    layer_prefixes: HF name prefix of each entry of the leading stacked axis (None: not stacked).
    source: (suffix, Layout), EXPERT or ZEROS, relative to each prefix (or absolute if not stacked)."""

    path: tuple[str, ...]
    spec: ParamSpec
    layer_prefixes: tuple[str, ...] | None
    source: Any


def _plans(cfg: ModelConfig, family: str, prefix: str = "") -> list[ParamPlan]:
    specs = param_specs(cfg)
    L, K = cfg.num_layers, cfg.num_dense_layers
    layer = lambda i: f"{prefix}model.layers.{i}."
    stacks = {
        "dense_layers": (tuple(layer(i) for i in range(K)), layer_map_of(cfg, family, moe=False)),
        "moe_layers": (tuple(layer(i) for i in range(K, L)), layer_map_of(cfg, family, moe=True)),
    }
    mtp_map: dict[tuple[str, ...], Any] = {
        ("enorm",): ("enorm.weight", COPY),
        ("hnorm",): ("hnorm.weight", COPY),
        ("eh_proj",): ("eh_proj.weight", T),
        ("norm",): ("shared_head.norm.weight", COPY),
    }
    mtp_map.update({("layer", *k): v for k, v in layer_map_of(cfg, family, moe=cfg.num_experts > 0).items()})
    stacks["mtp"] = (tuple(layer(L + k) for k in range(cfg.num_mtp_layers)), mtp_map)
    top = {
        ("embed",): (f"{prefix}model.embed_tokens.weight", COPY),
        ("final_norm",): (f"{prefix}model.norm.weight", COPY),
        ("lm_head",): (f"{prefix}lm_head.weight", T),
    }
    plans = []
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))[0]:
        keys = tuple(k.key for k in path)
        if keys[0] in stacks:
            prefixes, mapping = stacks[keys[0]]
            plans.append(ParamPlan(keys, spec, prefixes, mapping[keys[1:]]))
        else:
            plans.append(ParamPlan(keys, spec, None, top[keys]))
    return plans


def _path_str(path: tuple[str, ...]) -> str:
    return "params" + "".join(f"[{k!r}]" for k in path)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


class _Reader:
    """Reads HF tensors by name from a checkpoint directory, checking shapes and dequantising FP8."""

    def __init__(self, files: st.SafetensorsDir, fp8_block: tuple[int, int] | None):
        self.files, self.fp8_block = files, fp8_block

    def _missing(self, names: list[str], what: str) -> CheckpointError:
        return CheckpointError(
            f"tensor {' or '.join(repr(n) for n in names)} (for {what}) not found in "
            f"{self.files.dir} (searched: {self.files.file_names()})"
        )

    def tensor(self, name: str, hf_shape: tuple[int, ...], what: str) -> np.ndarray:
        """The tensor as stored (a lazy memmap view), or dequantised to float32 if FP8."""
        if name not in self.files:
            raise self._missing([name], what)
        info = self.files.info(name)
        if tuple(info.shape) != tuple(hf_shape):
            raise CheckpointError(
                f"tensor {name!r} (for {what}) has shape {list(info.shape)} in {info.file.name}; "
                f"expected {list(hf_shape)} from config.json"
            )
        arr = self.files.get(name)
        if info.dtype in (st.DTYPES["F8_E4M3"], st.DTYPES["F8_E5M2"]):
            arr = self._dequantise(name, arr)
        return arr

    def _dequantise(self, name: str, w: np.ndarray) -> np.ndarray:
        """DeepSeek block FP8: w_real = w_fp8 * scale_inv[i // block_out, j // block_in] (edge blocks
        are partial, so scale_inv has ceil(out/block_out) x ceil(in/block_in) entries)."""
        scale_name = name + "_scale_inv"
        if self.fp8_block is None:
            raise CheckpointError(
                f"tensor {name!r} is {w.dtype} but config.json has no quantization_config with "
                f"weight_block_size; cannot dequantise it"
            )
        if scale_name not in self.files:
            raise self._missing([scale_name], f"the block scales of FP8 tensor {name!r}")
        if w.ndim != 2:
            raise CheckpointError(f"FP8 tensor {name!r} has shape {list(w.shape)}; block dequantisation needs a matrix")
        bo, bi = self.fp8_block
        r, c = w.shape
        expect = (-(-r // bo), -(-c // bi))
        scale = np.asarray(self.files.get(scale_name), np.float32)
        if scale.shape != expect:
            raise CheckpointError(
                f"tensor {scale_name!r} has shape {list(scale.shape)}; expected {list(expect)} "
                f"for a {list(w.shape)} weight in {bo}x{bi} blocks"
            )
        full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:r, :c]
        return np.asarray(w, np.float32) * full

    def experts(self, prefix: str, kind: str, e: int, d: int, f: int, what: str) -> Callable[[tuple], np.ndarray]:
        """Reader of a [E, d, f] (gate/up) or [E, f, d] (down) block: index over (experts, ., .)."""
        per = lambda i: f"{prefix}mlp.experts.{i}.{kind}_proj.weight"
        hf_shape = (f, d) if kind in ("gate", "up") else (d, f)
        if per(0) in self.files:

            def read(idx: tuple) -> np.ndarray:
                ids = range(*idx[0].indices(e))
                return np.stack([np.asarray(self.tensor(per(i), hf_shape, what).T[idx[1:]]) for i in ids])

            return read
        fused = f"{prefix}mlp.experts.{'gate_up_proj' if kind in ('gate', 'up') else 'down_proj'}"
        if fused not in self.files:
            raise self._missing([per(0), fused], what)
        if kind in ("gate", "up"):
            w = self.tensor(fused, (e, 2 * f, d), what)
            w = w[:, :f] if kind == "gate" else w[:, f:]  # transformers' chunk(2): gate first, then up
        else:
            w = self.tensor(fused, (e, d, f), what)
        view = w.transpose(0, 2, 1)
        return lambda idx: np.asarray(view[idx])


def _slices(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _param_reader(plan: ParamPlan, cfg: ModelConfig, reader: _Reader) -> Callable[[tuple], np.ndarray]:
    """index (a tuple of slices over the parameter's shape) -> that block, as numpy in the param dtype."""
    spec = plan.spec
    dtype = jnp.dtype(spec.dtype or cfg.param_dtype)
    what = _path_str(plan.path)

    def one_layer(prefix: str) -> Callable[[tuple], np.ndarray]:
        shape = spec.shape[1:] if plan.layer_prefixes is not None else spec.shape
        src = plan.source
        if src == ZEROS:
            return lambda idx: np.zeros(tuple(s.stop - s.start for s in idx), np.float32)
        if src == EXPERT:
            e, dd, ff = (shape[0], shape[1], shape[2]) if plan.path[-1] != "down" else (shape[0], shape[2], shape[1])
            return reader.experts(prefix, plan.path[-1], e, dd, ff, what)
        name, layout = src
        view = layout.to_ours(reader.tensor(prefix + name, layout.hf_shape(shape), what))
        return lambda idx: np.asarray(view[idx])

    if plan.layer_prefixes is None:
        read = one_layer("")
        return lambda idx: read(idx).astype(dtype)

    prefixes = plan.layer_prefixes

    def read_stacked(idx: tuple) -> np.ndarray:
        layers = range(idx[0].start, idx[0].stop)
        return np.stack([one_layer(prefixes[i])(idx[1:]).astype(dtype) for i in layers])

    return read_stacked


def _place(shape: tuple[int, ...], sharding, read: Callable[[tuple], np.ndarray]) -> jax.Array:
    """Build a global array shard by shard: each distinct block is read once, put on every device that
    holds it, and dropped from the host before the next block is read."""
    if sharding is None:
        return jnp.asarray(read(_slices((slice(None),) * len(shape), shape)))
    by_block: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) for s in _slices(index, shape))
        by_block.setdefault(key, []).append(device)
    placed = {}
    for key, devices in by_block.items():
        block = read(tuple(slice(a, b) for a, b in key))
        for d in devices:
            placed[d] = jax.device_put(block, d)
    arrays = [placed[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _detect_prefix(files: st.SafetensorsDir) -> str:
    """'' for plain causal-LM checkpoints; e.g. 'language_model.' when a multimodal wrapper nests it."""
    for name in files.keys():
        if name.endswith("model.embed_tokens.weight") and not re.search(r"layers\.\d+\.", name):
            return name[: -len("model.embed_tokens.weight")]
    return ""


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def read_hf_config(path: str | os.PathLike) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(
            f"{path}: no config.json; a Hugging Face checkpoint directory holds config.json "
            f"and model.safetensors (or model.safetensors.index.json with its shards)"
        )
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None


def read_model_config(path: str | os.PathLike, dtype: str | None = None) -> tuple[ModelConfig, HFInfo]:
    """A Hugging Face checkpoint directory's ModelConfig (from config.json; num_mtp_layers = the MTP
    modules its tensors hold) and what else config.json says (HFInfo). Reads no tensor data."""
    cfg, info = model_config_from_hf(read_hf_config(path), dtype=dtype)
    files = _open(path)
    held = _count_mtp(files, _detect_prefix(files), cfg, info)
    key = (os.path.realpath(path), info.requested_mtp_layers, held)
    if held < info.requested_mtp_layers and key not in _MTP_WARNED:
        _MTP_WARNED.add(key)
        log.warning(
            "%s: config.json asks for %d MTP layer(s) (num_nextn_predict_layers) but the checkpoint holds "
            "%d (transformers drops them on save); loading with num_mtp_layers=%d",
            path,
            info.requested_mtp_layers,
            held,
            held,
        )
    return dataclasses.replace(cfg, num_mtp_layers=held), info


# (directory, MTP layers asked, held) already warned about: one run reads a checkpoint's config
# several times (model.from, train.init_from, its weights), and says so once
_MTP_WARNED: set[tuple[str, int, int]] = set()


def _open(path: str | os.PathLike) -> st.SafetensorsDir:
    try:
        return st.SafetensorsDir(path)
    except st.SafetensorsError as e:
        raise CheckpointError(str(e)) from None


def read_params(path: str | os.PathLike, cfg: ModelConfig, info: HFInfo, shardings: Any = None) -> dict:
    """The parameters of a Hugging Face checkpoint directory laid out as `param_specs(cfg)`, in
    cfg.param_dtype (the router float32), each placed on its sharding in `shardings` (a tree like
    the params; None: the default device).

    Shard by shard (`_place`): only the blocks this process's devices hold are read
    (`addressable_devices_indices_map`), so on several hosts each process reads its own shards only."""
    files = _open(path)
    reader = _Reader(files, info.fp8_block)
    params: dict = {}
    for plan in _plans(cfg, info.family, _detect_prefix(files)):
        sharding = None
        if shardings is not None:
            sharding = shardings
            for k in plan.path:
                sharding = sharding[k]
        _set(params, plan.path, _place(plan.spec.shape, sharding, _param_reader(plan, cfg, reader)))
    return params


def from_pretrained(
    path: str | os.PathLike, mesh: Mesh | None = None, *, rules: ShardingRules | None = None, dtype: Any = None
) -> tuple[ModelConfig, dict]:
    """Load a Hugging Face checkpoint directory (deepseek_v3 / Kimi K2, deepseek_v2, qwen3_moe).

    path: directory with config.json and model.safetensors or model.safetensors.index.json + shards.
    mesh/rules: place each parameter on its sharding (`param_shardings`); None: default device.
    dtype: "float32" or "bfloat16" for the parameters (default: the checkpoint's dtype; FP8 weights
    are dequantised to it). The router stays float32.
    Returns (ModelConfig, params) with params laid out as `param_specs(cfg)`.
    """
    if dtype is not None and not isinstance(dtype, str):
        dtype = jnp.dtype(dtype).name  # jnp.bfloat16 / np.float32 -> "bfloat16" / "float32"
    cfg, info = read_model_config(path, dtype)
    shardings = param_shardings(cfg, mesh, rules) if mesh is not None else None
    return cfg, read_params(path, cfg, info, shardings)


def _count_mtp(files: st.SafetensorsDir, prefix: str, cfg: ModelConfig, info: HFInfo) -> int:
    """The MTP modules the tensors hold, at most the number config.json asks for."""
    found, first = 0, cfg.num_layers  # MTP module i is layer num_layers + i in DeepSeek's naming
    while found < info.requested_mtp_layers and f"{prefix}model.layers.{first + found}.eh_proj.weight" in files:
        found += 1
    return found


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; use bytes or e.g. '500MB', '5GB'")
    unit = (m.group(2) or "B").upper()
    mult = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    return int(float(m.group(1)) * mult)


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if k not in tree:
            raise CheckpointError(
                f"save_pretrained: {_path_str(path)} is missing from params; the tree must follow param_specs(cfg)"
            )
        tree = tree[k]
    return tree


def _layer(a: Any, li: int) -> Any:
    return a[li]


def _whole(a: Any) -> Any:
    return a


def _expert_slice(a: Any, take: Callable[[Any], Any], e: int) -> Any:
    return take(a)[e].T


def _zeros_like_last(a: Any) -> np.ndarray:
    return np.zeros(a.shape[-1:], np.float32)


def _to_hf(a: Any, take: Callable[[Any], Any], layout: Any) -> Any:
    return layout.to_hf(take(a))


def _hf_entries(params: dict, cfg: ModelConfig, family: str, out_dtype: np.dtype):
    """[(hf name, dtype, shape, producer)] in param order; producer(host param) -> the HF array."""
    # (param path, HF name, dtype, HF shape, host param -> HF array)
    entries: list[tuple[tuple[str, ...], str, np.dtype, tuple[int, ...], Callable[[Any], Any]]] = []
    for plan in _plans(cfg, family):
        value = _get(params, plan.path)
        if tuple(value.shape) != plan.spec.shape:
            raise CheckpointError(
                f"save_pretrained: {_path_str(plan.path)} has shape {list(value.shape)}; "
                f"cfg expects {list(plan.spec.shape)}"
            )
        dt = np.dtype(np.float32) if plan.spec.dtype == "float32" else out_dtype
        prefixes = plan.layer_prefixes if plan.layer_prefixes is not None else (None,)
        shape = plan.spec.shape[1:] if plan.layer_prefixes is not None else plan.spec.shape
        for li, prefix in enumerate(prefixes):
            take: Callable[[Any], Any] = functools.partial(_layer, li=li) if prefix is not None else _whole
            pre = prefix or ""
            if plan.source == ZEROS:
                continue  # the HF family has no such tensor (router bias of a softmax router)
            if plan.source == EXPERT:
                kind = plan.path[-1]
                for e in range(shape[0]):
                    entries.append(
                        (
                            plan.path,
                            f"{pre}mlp.experts.{e}.{kind}_proj.weight",
                            dt,
                            shape[1:][::-1],
                            functools.partial(_expert_slice, take=take, e=e),
                        )
                    )
                continue
            name, layout = plan.source
            if plan.path[-1] == "router_bias" and cfg.topk_method == "greedy":
                # greedy sigmoid routing is exported as deepseek_v3 with one group, whose router adds
                # the bias for selection: our greedy router ignores it, so write zeros
                entries.append((plan.path, pre + name, dt, shape, _zeros_like_last))
                continue
            entries.append(
                (
                    plan.path,
                    pre + name,
                    dt,
                    layout.hf_shape(shape),
                    functools.partial(_to_hf, take=take, layout=layout),
                )
            )
    # DeepSeek MTP modules carry their own copies of the (shared) embedding and output head
    for k in range(cfg.num_mtp_layers):
        pre = f"model.layers.{cfg.num_layers + k}."
        v, d = cfg.vocab_size, cfg.hidden_size
        entries.append((("embed",), pre + "embed_tokens.weight", out_dtype, (v, d), lambda a: a))
        head = ("embed",) if cfg.tie_word_embeddings else ("lm_head",)
        entries.append(
            (
                head,
                pre + "shared_head.head.weight",
                out_dtype,
                (v, d),
                (lambda a: a) if cfg.tie_word_embeddings else (lambda a: a.T),
            )
        )
    return entries


def save_pretrained(
    params: dict,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
) -> Path:
    """Write `params` (laid out as `param_specs(cfg)`, sharded or not) as a Hugging Face checkpoint:
    config.json plus model.safetensors, or model-XXXXX-of-YYYYY.safetensors shards and
    model.safetensors.index.json when larger than max_shard_size (bytes or '5GB'-style).

    Experts are written in the hub layout (`mlp.experts.{e}.gate_proj.weight`, ...). Parameters are
    gathered to the host one at a time; with several processes all must call this, process 0 writes.
    dtype: "float32" or "bfloat16" for the written weights (default cfg.param_dtype); routers stay float32.
    """
    family = family_for(cfg)
    out_dtype_name = dtype or cfg.param_dtype
    if out_dtype_name not in ("float32", "bfloat16"):
        raise ConfigError(f"save_pretrained: dtype={out_dtype_name!r} is not supported; accepted: float32, bfloat16")
    out_dtype = np.dtype(jnp.dtype(out_dtype_name))
    entries = _hf_entries(params, cfg, family, out_dtype)
    limit = _parse_size(max_shard_size)
    shards: list[list] = [[]]
    size = 0
    for ent in entries:
        nbytes = int(np.prod(ent[3], dtype=np.int64)) * ent[2].itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(ent)
        size += nbytes
    writer = jax.process_index() == 0
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_config_from_model(cfg, out_dtype_name), indent=2) + "\n")
    names = (
        [st.SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    cache: dict[str, Any] = {"path": None, "host": None}

    def host(path: tuple[str, ...]) -> np.ndarray:
        if cache["path"] != path:  # one gathered parameter at a time
            cache["host"] = None
            cache["host"] = _to_host(_get(params, path))
            cache["path"] = path
        return cache["host"]

    def arrays(shard: list) -> Iterator[np.ndarray]:
        for path, _name, dt, _shape, produce in shard:
            yield np.asarray(produce(host(path))).astype(dt)

    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        if writer:
            total += st.write_file(out / fname, [(n, dt, tuple(s)) for _, n, dt, s, _ in shard], arrays(shard))
        else:
            for _ in arrays(shard):  # take part in the collective gathers
                pass
        weight_map.update({name: fname for _, name, _, _, _ in shard})
    if writer and len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / st.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out


def hf_tensors(
    params: dict, cfg: ModelConfig, *, dtype: str | None = None
) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """The tensors `save_pretrained` writes, in its order, without a file: [(HF name, dtype name, HF
    shape, make)], `make()` -> the host array (gathered when called, one parameter at a time).
    For senders that stream a checkpoint (vLLM's weight-transfer routes, weightsync/nccl.py)."""
    out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    out = []
    for path, name, dt, shape, produce in _hf_entries(params, cfg, family_for(cfg), out_dtype):
        make = functools.partial(lambda p, f, d: np.asarray(f(_to_host(_get(params, p)))).astype(d), path, produce, dt)
        out.append((name, "bfloat16" if dt == np.dtype(jnp.bfloat16) else dt.name, tuple(shape), make))
    return out

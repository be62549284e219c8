"""The matrix products of a compiled XLA program, each timed alone: a floor on the program's time.

`dot_inventory(hlo_text)` reads the optimised HLO text of a compiled program
(`jax.jit(f).lower(...).compile().as_text()`) and lists every `dot` instruction with its operand
shapes, contracting and batch dimensions and how many times one run of the program executes it
(the product of the known trip counts of the while loops around it; a loop without a known trip
count counts once and is reported). `time_dots(inventory)` times each distinct product on its own,
`lax.dot_general` on random data in a compiled loop that reuses the output buffer, and returns
(dot, count, seconds); `time_dots_torch` times the same products as `torch.bmm`.

The sum of count x seconds is what the program's matrix products cost on this backend if nothing
else took any time and each product ran at the speed XLA gives it on its own: a floor for the
program's wall time, and so a ceiling on how far the program can be sped up without a faster
matmul or fewer FLOPs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

_COMP = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? (\w[\w-]*)\((.*)$")
_SHAPE = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DIMS = {
    k: re.compile(k + r"=\{([\d,]*)\}")
    for k in ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims")
}


@dataclass(frozen=True)
class Dot:
    dtype: str
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]

    @property
    def flops(self) -> int:
        bsz, m, k, n = bmm_layout(self)[2]
        return 2 * bsz * m * k * n

    def __str__(self) -> str:
        b = f" batch {self.lhs_batch}x{self.rhs_batch}" if self.lhs_batch else ""
        return (
            f"{self.dtype}{list(self.lhs)} . {list(self.rhs)} contract {self.lhs_contracting}x{self.rhs_contracting}{b}"
        )


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _shape(typ: str) -> tuple[str, str]:
    """(element type, comma-separated dims) of an HLO array type such as f32[64,32]."""
    m = _SHAPE.match(typ)
    if m is None:
        raise ValueError(f"not an HLO array type: {typ!r}")
    return m.group(1), m.group(2)


def _dims(rx: re.Pattern[str], line: str) -> tuple[int, ...]:
    m = rx.search(line)
    return _ints(m.group(1)) if m else ()


def dot_inventory(hlo_text: str) -> tuple[dict[Dot, int], list[str]]:
    """-> ({dot: executions per program run}, [notes on loops without a known trip count])."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    # edges: caller -> [(callee, multiplier)]
    edges: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}
    notes = []
    for c, lines in comps.items():
        for line in lines:
            for kind, target in _CALLEE.findall(line):
                names = re.findall(r"%([\w.\-]+)", target)
                mult = 1
                if kind == "body":
                    t = _TRIP.search(line)
                    if t:
                        mult = int(t.group(1))
                    else:
                        notes.append(f"while loop with body {names[0]} has no known trip count: counted once")
                for n in names:
                    if n in comps:
                        edges[c].append((n, mult))
    count: dict[str, int] = {}

    def visit(c: str, n: int) -> None:
        count[c] = count.get(c, 0) + n
        for callee, mult in edges[c]:
            visit(callee, n * mult)

    visit(entry, 1)
    dots: dict[Dot, int] = {}
    for c, lines in comps.items():
        shapes = {}
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, typ, op, rest = m.groups()
            shapes[name] = typ
            if op != "dot" or not count.get(c):
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            (lt, ls), (rt, rs) = (_shape(shapes[o]) for o in operands[:2])
            d = {k: _dims(r, line) for k, r in _DIMS.items()}
            dot = Dot(
                lt,
                _ints(ls),
                _ints(rs),
                d["lhs_contracting_dims"],
                d["rhs_contracting_dims"],
                d["lhs_batch_dims"],
                d["rhs_batch_dims"],
            )
            dots[dot] = dots.get(dot, 0) + count[c]
    return dots, sorted(set(notes))


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def time_dots(dots: dict[Dot, int], repeats: int = 3, inner: int = 8) -> list[tuple[Dot, int, float]]:
    """-> [(dot, count, seconds of one execution)], costliest total first.

    Each product runs `inner` times inside one compiled loop whose carry holds its output, so the
    output buffer is reused as it is inside a program (a fresh output over glibc's 32 MB mmap
    threshold costs a page fault per 4 KB on every call: about 40% of a [512,32000] float32 product
    here). The operand gets one element rewritten per iteration so that the product cannot be
    hoisted out of the loop. Best of `repeats` runs of the loop, divided by `inner`."""
    out = []
    key = jax.random.key(0)
    for dot in dots:
        dt = jnp.dtype(_DTYPES.get(dot.dtype, dot.dtype))
        a = jax.random.normal(key, dot.lhs, dt)
        b = jax.random.normal(key, dot.rhs, dt)
        dims = ((dot.lhs_contracting, dot.rhs_contracting), (dot.lhs_batch, dot.rhs_batch))
        prod = lambda x, y, dims=dims: jax.lax.dot_general(x, y, dims)
        shape = jax.eval_shape(prod, a, b)

        def loop(x, y, prod=prod, shape=shape):
            def body(i, carry):
                x, _ = carry
                x = x.at[(0,) * x.ndim].set(i.astype(x.dtype))
                return x, prod(x, y)

            return jax.lax.fori_loop(0, inner, body, (x, jnp.zeros(shape.shape, shape.dtype)))[1]

        f = jax.jit(loop)
        jax.block_until_ready(f(a, b))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(a, b))
            best = min(best, time.perf_counter() - t0)
        out.append((dot, dots[dot], best / inner))
    return sorted(out, key=lambda r: -r[1] * r[2])


def bmm_layout(dot: Dot) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int, int, int]]:
    """-> (lhs axis order, rhs axis order, (batch, m, k, n)): the `dot` as a batched matmul
    [batch, m, k] x [batch, k, n] of the permuted and reshaped operands. Its [batch, m, n] result,
    reshaped, is dot_general's output (batch dims, then lhs free, then rhs free)."""
    free_l = tuple(i for i in range(len(dot.lhs)) if i not in dot.lhs_contracting + dot.lhs_batch)
    free_r = tuple(i for i in range(len(dot.rhs)) if i not in dot.rhs_contracting + dot.rhs_batch)
    size = lambda shape, idx: int(np.prod([shape[i] for i in idx]))
    dims = (
        size(dot.lhs, dot.lhs_batch),
        size(dot.lhs, free_l),
        size(dot.lhs, dot.lhs_contracting),
        size(dot.rhs, free_r),
    )
    return dot.lhs_batch + free_l + dot.lhs_contracting, dot.rhs_batch + dot.rhs_contracting + free_r, dims


def time_dots_torch(dots: dict[Dot, int], repeats: int = 3, device: str = "cpu") -> dict[Dot, float]:
    """The same products in torch's matmul library (oneDNN/MKL on CPU, cuBLAS on GPU): each as one
    `torch.bmm` into a preallocated output (operands permuted to [batch, m, k] x [batch, k, n]
    beforehand, outside the timing), so that, like `time_dots`, no output is allocated per call.
    -> best seconds of one execution each."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for dot in dots:
        dt = getattr(torch, _DTYPES.get(dot.dtype, dot.dtype))
        lhs_order, rhs_order, (bsz, m, k, n) = bmm_layout(dot)
        a = torch.randn(dot.lhs, dtype=dt, device=device).permute(*lhs_order).reshape(bsz, m, k).contiguous()
        b = torch.randn(dot.rhs, dtype=dt, device=device).permute(*rhs_order).reshape(bsz, k, n).contiguous()
        c = torch.empty((bsz, m, n), dtype=dt, device=device)
        torch.bmm(a, b, out=c)
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.bmm(a, b, out=c)
            sync()
            best = min(best, time.perf_counter() - t0)
        out[dot] = best
    return out

"""The matrix products of a compiled XLA program, each timed alone: a floor on the program's time.

`dot_inventory(hlo_text)` reads the optimised HLO text of a compiled program
(`jax.jit(f).lower(...).compile().as_text()`) and lists every `dot` instruction with its operand
shapes, contracting and batch dimensions and how many times one run of the program executes it
(the product of the known trip counts of the while loops around it; a loop without a known trip
count counts once and is reported). `time_dots(inventory)` runs each distinct product alone through
`jax.jit(lax.dot_general)` on random data and returns the sum of best-of-N time x count.

That sum is what the program's matrix products cost on this backend if nothing else took any time
and each product ran at the speed XLA gives it on its own: a floor for the program's wall time,
and so a ceiling on how far the program can be sped up without a faster matmul or fewer FLOPs.
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
_DIMS = {k: re.compile(k + r"=\{([\d,]*)\}") for k in
         ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims")}


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
        free_l = [d for i, d in enumerate(self.lhs) if i not in self.lhs_contracting + self.lhs_batch]
        free_r = [d for i, d in enumerate(self.rhs) if i not in self.rhs_contracting + self.rhs_batch]
        return 2 * int(np.prod([self.lhs[i] for i in self.lhs_batch + self.lhs_contracting]) *
                       np.prod(free_l) * np.prod(free_r))

    def __str__(self) -> str:
        b = f" batch {self.lhs_batch}x{self.rhs_batch}" if self.lhs_batch else ""
        return (f"{self.dtype}{list(self.lhs)} . {list(self.rhs)} contract "
                f"{self.lhs_contracting}x{self.rhs_contracting}{b}")


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


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
            (lt, ls), (rt, rs) = (_SHAPE.match(shapes[o]).groups() for o in operands[:2])
            d = {k: _ints(r.search(line).group(1)) if r.search(line) else () for k, r in _DIMS.items()}
            dot = Dot(lt, _ints(ls), _ints(rs), d["lhs_contracting_dims"], d["rhs_contracting_dims"],
                      d["lhs_batch_dims"], d["rhs_batch_dims"])
            dots[dot] = dots.get(dot, 0) + count[c]
    return dots, sorted(set(notes))


def time_dots(dots: dict[Dot, int], repeats: int = 3) -> list[tuple[Dot, int, float]]:
    """-> [(dot, count, best seconds of one execution alone)], slowest total first."""
    out = []
    key = jax.random.key(0)
    for dot in dots:
        dt = jnp.dtype(dot.dtype.replace("f32", "float32").replace("bf16", "bfloat16").replace("f16", "float16"))
        a = jax.random.normal(key, dot.lhs, dt)
        b = jax.random.normal(key, dot.rhs, dt)
        dims = ((dot.lhs_contracting, dot.rhs_contracting), (dot.lhs_batch, dot.rhs_batch))
        f = jax.jit(lambda x, y, dims=dims: jax.lax.dot_general(x, y, dims))
        jax.block_until_ready(f(a, b))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(a, b))
            best = min(best, time.perf_counter() - t0)
        out.append((dot, dots[dot], best))
    return sorted(out, key=lambda r: -r[1] * r[2])


def einsum_spec(dot: Dot) -> str:
    """The `dot` as an einsum string (batch dims first in the output, then lhs free, then rhs free:
    dot_general's output order)."""
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    lhs = [None] * len(dot.lhs)
    rhs = [None] * len(dot.rhs)
    batch = []
    for i, j in zip(dot.lhs_batch, dot.rhs_batch):
        lhs[i] = rhs[j] = c = next(letters)
        batch.append(c)
    for i, j in zip(dot.lhs_contracting, dot.rhs_contracting):
        lhs[i] = rhs[j] = next(letters)
    free_l = [lhs.__setitem__(i, next(letters)) or lhs[i] for i in range(len(lhs)) if lhs[i] is None]
    free_r = [rhs.__setitem__(i, next(letters)) or rhs[i] for i in range(len(rhs)) if rhs[i] is None]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(batch + free_l + free_r)}"


def time_dots_torch(dots: dict[Dot, int], repeats: int = 3, device: str = "cpu") -> dict[Dot, float]:
    """The same products through torch.einsum (torch's own matmul library): best seconds each."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for dot in dots:
        dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dot.dtype]
        a = torch.randn(dot.lhs, dtype=dt, device=device)
        b = torch.randn(dot.rhs, dtype=dt, device=device)
        spec = einsum_spec(dot)
        torch.einsum(spec, a, b)
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.einsum(spec, a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
        out[dot] = best
    return out

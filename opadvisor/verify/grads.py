"""Every parameter's gradient at step 1, original against rewrite, tensor by tensor.

The harness of each parity run writes the gradients of the lead optimizer's parameters, as the optimizer
is about to take its first step, into a folder (`save_gradients`): `index.json`, one entry per parameter in
the optimizer's order ({"name", "shape", "file": raw float32, or null when it has no gradient, "skipped"}),
and the files. The parent compares the two folders (`compare_gradients`), matched by position (both
programs build their optimizer from the same parameters; the names are for the report):

    relative error = ||after - before||_2 / max(||before||_2, rms * sqrt(numel))

where rms is the root mean square of every gradient element of the original: a tensor whose gradient is
tiny next to the rest (a bias that nearly cancels) is judged against the gradient's typical size, not
against its own near-zero norm. A tensor that has a gradient in one program and none in the other (a
learnable temperature that a rewrite turned into a constant) is a mismatch. The worst tensor is named:
the first in the optimizer's order among those whose error equals the largest up to rounding (TIE_RTOL).

At most MAX_ELEMENTS gradient elements are written per program (4 bytes each); a larger model's remaining
parameters are marked skipped and said so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INDEX = "index.json"
MAX_ELEMENTS = 1 << 28  # 1 GiB of float32 per program


def save_gradients(optimizer: Any, names: dict[int, str], folder: Path) -> None:
    """Write the gradients of `optimizer`'s parameters (see the module doc); `names`: id(param) -> name."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    index, written = [], 0
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            entry: dict[str, Any] = {
                "name": names.get(id(p)) or f"param_groups[{gi}][{pi}]",
                "shape": list(p.shape),
                "file": None,
                "skipped": False,
            }
            grad = p.grad
            if grad is not None and (grad.is_complex() or written + grad.numel() > MAX_ELEMENTS):
                entry["skipped"] = True
            elif grad is not None:
                g = grad.detach()
                g = g.to_local() if callable(getattr(g, "to_local", None)) else g  # FSDP2: this rank's shard
                g = g.to_dense() if g.is_sparse else g
                entry["file"] = f"{len(index)}.f32"
                data = g.to(torch.float32).cpu().contiguous().numpy()
                data.tofile(folder / entry["file"])
                written += g.numel()
            index.append(entry)
    (folder / INDEX).write_text(json.dumps(index), encoding="utf-8")


@dataclass
class TensorDiff:
    name: str
    shape: list[int]
    rel_error: float  # see the module doc; inf when only one program has a gradient
    max_abs_diff: float | None = None
    note: str = ""


@dataclass
class GradientCheck:
    compared: int  # tensors compared
    tolerance: float  # the largest relative error allowed per tensor
    worst: TensorDiff | None = None
    failing: list[TensorDiff] = field(default_factory=list)  # over the tolerance, worst first
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failing

    def words(self) -> str:
        if self.worst is None:
            return f"gradients at step 1: {self.compared} tensors compared"
        w = self.worst
        return (
            f"gradients at step 1: {self.compared} tensors compared, worst {w.name} {list(w.shape)}: "
            f"relative error {w.rel_error:.3g} (tolerance {self.tolerance:.3g})"
            + (f", {w.note}" if w.note else "")
        )

    def to_json(self) -> dict[str, Any]:
        def one(d: TensorDiff) -> dict[str, Any]:
            rel = d.rel_error if math.isfinite(d.rel_error) else None
            return {
                "name": d.name,
                "shape": d.shape,
                "rel_error": rel,
                "max_abs_diff": d.max_abs_diff,
                "note": d.note,
            }

        return {
            "ok": self.ok,
            "compared": self.compared,
            "tolerance": self.tolerance,
            "worst": one(self.worst) if self.worst is not None else None,
            "failing": [one(d) for d in self.failing[:MAX_LISTED]],
            "failing_count": len(self.failing),
            "notes": self.notes,
        }


MAX_LISTED = 10


def _read(folder: Path) -> list[dict[str, Any]]:
    index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
    if not isinstance(index, list):
        raise ValueError(f"{folder / INDEX} is not a list")
    return index


def _load(folder: Path, entry: dict[str, Any]):
    import numpy

    return numpy.fromfile(folder / entry["file"], dtype=numpy.float32).astype(numpy.float64)


def compare_gradients(before: Path, after: Path, tolerance: float) -> GradientCheck:
    """Compare the gradient folders of the original (`before`) and the rewrite (`after`)."""
    import numpy

    b_index, a_index = _read(before), _read(after)
    check = GradientCheck(compared=0, tolerance=tolerance)
    if len(b_index) != len(a_index):
        check.notes.append(
            f"the optimizers hold {len(b_index)} parameters before and {len(a_index)} after: "
            "compared the first ones by position"
        )
    total_sq = total_n = 0.0
    for entry in b_index:
        if entry["file"]:
            g = _load(before, entry)
            g = g[numpy.isfinite(g)]
            total_sq += float(numpy.dot(g, g))
            total_n += g.size
    rms = math.sqrt(total_sq / total_n) if total_n else 0.0
    diffs = []
    for b, a in zip(b_index, a_index, strict=False):
        diff = _compare_one(before, after, b, a, rms)
        if diff is None:
            continue
        check.compared += 1
        diffs.append(diff)
    skipped = sum(1 for e in (*b_index, *a_index) if e.get("skipped"))
    if skipped:
        check.notes.append(f"{skipped} gradient(s) not compared (over {MAX_ELEMENTS} elements, or complex)")
    check.worst = _named_worst(diffs)
    diffs.sort(key=lambda d: (d is not check.worst, -d.rel_error))
    check.failing = [d for d in diffs if not d.rel_error <= tolerance]
    return check


# Relative errors this close to the largest are the same error: a change that scales every gradient alike
# (a loss scaled by a constant) gives each tensor the same error up to float rounding, and which tensor's
# rounding came out largest is noise that varies from one build of torch to the next.
TIE_RTOL = 1e-4


def _named_worst(diffs: list[TensorDiff]) -> TensorDiff | None:
    """The tensor named as the worst: the first in the optimizer's order whose relative error is within
    TIE_RTOL of the largest."""
    if not diffs:
        return None
    top = max(d.rel_error for d in diffs)
    return next(d for d in diffs if d.rel_error >= top * (1 - TIE_RTOL))


def _compare_one(
    before: Path, after: Path, b: dict[str, Any], a: dict[str, Any], rms: float
) -> TensorDiff | None:
    import numpy

    name = b["name"] if b["name"] == a["name"] else f"{b['name']} (after: {a['name']})"
    if b.get("skipped") or a.get("skipped"):
        return None
    if b["file"] is None and a["file"] is None:
        return None  # no gradient in either: nothing to compare
    if (b["file"] is None) != (a["file"] is None):
        which = "the rewrite" if a["file"] is None else "the original"
        return TensorDiff(name, b["shape"], math.inf, None, f"no gradient in {which}")
    if b["shape"] != a["shape"]:
        return TensorDiff(name, b["shape"], math.inf, None, f"shape {a['shape']} after")
    gb, ga = _load(before, b), _load(after, a)
    if gb.size == 0:
        return None
    # equal values (infinities included) and NaN where both have NaN count as no difference
    same = (gb == ga) | (numpy.isnan(gb) & numpy.isnan(ga))
    delta = numpy.where(same, 0.0, ga - gb)
    if not numpy.isfinite(delta).all():
        return TensorDiff(name, b["shape"], math.inf, None, "NaN or infinity in one program only")
    err = float(numpy.sqrt(numpy.dot(delta, delta)))
    finite = numpy.where(numpy.isfinite(gb), gb, 0.0)
    scale = max(float(numpy.sqrt(numpy.dot(finite, finite))), rms * math.sqrt(gb.size))
    rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    return TensorDiff(name, b["shape"], rel, float(numpy.abs(delta).max()))

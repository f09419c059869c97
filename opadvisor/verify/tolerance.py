"""Parity tolerances derived from the precision and the amount of work, and said in words.

Two programs that compute the same function differ by rounding: a fused kernel rounds fewer times, or sums
in another order. How much depends on

    u   the unit roundoff of the lowest precision either program computed in (the harness reports it):
        fp32 2^-24, tf32 2^-11 (matmul inputs keep 10 mantissa bits), bf16 2^-8, fp16 2^-11
    K   the longest reduction of the first step: the largest of each parameterised module's input
        features (reduced in its forward) and its rows (tokens: reduced in its weight gradient)
    D   the depth: parameterised modules the first step ran (rounding differences of layers add up)

Summation in another order moves a float32 accumulation by about u32 * sqrt(K) (u32 = 2^-24, random
rounding over K terms); a low-precision result is rounded once per layer, u. Layer after layer such
differences add up like a random walk, so one step's relative difference is about

    e = max(u, u32 * sqrt(K)) * sqrt(D)

and the tolerances are multiples of it, never tighter than the defaults per precision that earlier runs
were measured against (`LOSS_TOLERANCE`, `GRAD_NORM_RTOL`):

    loss, per step          rtol max(LOSS_TOLERANCE rtol, e), atol LOSS_TOLERANCE atol
    gradient norm, step 1   rtol max(GRAD_NORM_RTOL, 2 e)
    each gradient, step 1   relative L2 error <= GRAD_FACTOR * e, within [GRAD_RTOL_MIN, GRAD_RTOL_MAX]

A real error (a flipped mask, a lost scale, a gradient that stops flowing) is of order 1 and stays far
above these. `--rtol` / `--atol` replace the loss tolerance; the gradient tolerances scale with the same
factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8, "fp16": 2.0**-11}
ACCUMULATE = 2.0**-24  # float32 accumulation (matmuls and reductions accumulate in fp32 under autocast)
LOSS_TOLERANCE = {"fp32": (1e-4, 1e-5), "tf32": (1e-3, 1e-4), "bf16": (2e-2, 1e-3), "fp16": (2e-2, 1e-3)}
GRAD_NORM_RTOL = {"fp32": 1e-3, "tf32": 1e-2, "bf16": 5e-2, "fp16": 5e-2}
GRAD_FACTOR = 4.0
GRAD_RTOL_MIN = 1e-4  # as the fp32 loss default: a real error is orders larger
GRAD_RTOL_MAX = 0.25


@dataclass
class Tolerances:
    precision: str
    unit_roundoff: float
    reduction: int  # K
    depth: int  # D
    epsilon: float  # e, the expected relative difference of one step
    loss_rtol: float
    loss_atol: float
    grad_norm_rtol: float
    grad_rtol: float  # per gradient tensor: relative L2 error
    given: bool = False  # --rtol/--atol were passed

    def words(self) -> str:
        """ "bf16 (u 3.9e-03), longest reduction 8192, 98 layers with parameters: ..." """
        source = "from --rtol/--atol" if self.given else "derived"
        return (
            f"tolerances {source}: {self.precision} (unit roundoff {self.unit_roundoff:.2g}), longest "
            f"reduction {self.reduction}, {self.depth} modules with parameters -> expected difference "
            f"{self.epsilon:.2g} per step; loss rtol {self.loss_rtol:.2g} atol {self.loss_atol:.2g}, "
            f"gradient norm rtol {self.grad_norm_rtol:.2g}, each gradient tensor {self.grad_rtol:.2g} "
            "(relative L2 error)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "unit_roundoff": self.unit_roundoff,
            "longest_reduction": self.reduction,
            "depth": self.depth,
            "expected_difference": self.epsilon,
            "loss_rtol": self.loss_rtol,
            "loss_atol": self.loss_atol,
            "grad_norm_rtol": self.grad_norm_rtol,
            "grad_rtol": self.grad_rtol,
            "given": self.given,
        }


def derive(
    precision: str, reduction: int, depth: int, rtol: float | None = None, atol: float | None = None
) -> Tolerances:
    """The tolerances for `precision` and the work of one step (see the module doc)."""
    u = UNIT_ROUNDOFF.get(precision, UNIT_ROUNDOFF["fp32"])
    table_rtol, table_atol = LOSS_TOLERANCE.get(precision, LOSS_TOLERANCE["fp32"])
    k, d = max(1, reduction), max(1, depth)
    e = max(u, ACCUMULATE * math.sqrt(k)) * math.sqrt(d)
    loss_rtol = max(table_rtol, e)
    scale = 1.0 if rtol is None else rtol / loss_rtol
    grad_rtol = min(GRAD_RTOL_MAX, max(GRAD_RTOL_MIN, GRAD_FACTOR * e))
    return Tolerances(
        precision=precision,
        unit_roundoff=u,
        reduction=k,
        depth=d,
        epsilon=e,
        loss_rtol=loss_rtol if rtol is None else rtol,
        loss_atol=table_atol if atol is None else atol,
        grad_norm_rtol=max(GRAD_NORM_RTOL.get(precision, GRAD_NORM_RTOL["fp32"]), 2 * e) * scale,
        grad_rtol=grad_rtol * scale,
        given=rtol is not None or atol is not None,
    )

"""Which implementation each fused call of the rewritten program ran, and what that means for the verdict.

The harness reads `opadvisor.kernels.dispatch_counts()` at the end of each run: per op ("masked_softmax",
"bias_dropout_add", "cross_entropy", "padded_linear", "dropout", "quick_gelu", "disentangled_bias",
"cell_sequence") the calls that took each path:

    kernel     the fused implementation (a Triton kernel, compiled or interpreted; a padded matrix product)
    chain      the plain PyTorch chain by design: tensors under the op's size threshold, an aligned
               padded_linear, or a call traced by torch.compile that traces the chain
    reference  the PyTorch reference: CPU tensors without Triton's interpreter, no Triton, or a dtype,
               layout or argument the kernel does not cover

Python-level counts: a torch.compile'd region counts once per trace, a CUDA graph once per capture. Each
applied rule whose codemod calls a kernel (`RuleCodemod.KERNEL_OP`) is checked: a warning says when the
rewritten program never called that op, or called it but never ran its kernel (then the timing measured
the chain or the reference, not the kernel the rewrite was for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NamesAdded = Callable[[str], set[str]]  # rule -> the identifiers its rewrite added to the source

PATH_WORDS = {
    "chain": "the plain PyTorch chain (tensors under the op's size threshold, or traced by torch.compile)",
    "reference": "the PyTorch reference (CPU tensors, no Triton, or arguments the kernel does not cover)",
}


@dataclass
class FusedCalls:
    op: str  # its name in the dispatch record
    rules: list[str]  # the applied rules whose rewrite calls it (empty: called by the script itself)
    counts: dict[str, int]  # path -> calls
    run: str  # which run of the rewrite this was read from: "timing" | "parity"

    @property
    def kernel_calls(self) -> int:
        return self.counts.get("kernel", 0)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "rules": self.rules, "counts": self.counts, "run": self.run}


def kernel_ops(rules: list[str], names_added: NamesAdded | None = None) -> dict[str, list[str]]:
    """{op: [applied rules whose codemod calls it]} from each codemod's KERNEL_OP. A codemod that declares
    a tuple (one op per form it rewrites: fuse_region; or an op for some of its forms only: fused_optimizer,
    whose Adam and SGD fixes are fused=True) calls those whose name, in any case, its rewrite added
    (`names_added(rule)`, from the applied files: "AdamW" for "adamw"); without `names_added`, all of them."""
    from opadvisor.errors import UserError
    from opadvisor.rewrite.registry import get_codemod

    ops: dict[str, list[str]] = {}
    for rule in rules:
        try:
            declared = get_codemod(rule).KERNEL_OP
        except (UserError, ImportError, AttributeError):
            continue
        named = (declared,) if isinstance(declared, str) else declared or ()
        if isinstance(declared, tuple) and names_added is not None:
            added = {name.lower() for name in names_added(rule)}
            named = tuple(op for op in named if op.lower() in added)
        for op in named:
            ops.setdefault(op, []).append(rule)
    return ops


def fused_calls(
    rules: list[str], dispatch: dict[str, Any] | None, run: str, names_added: NamesAdded | None = None
) -> tuple[list[FusedCalls], list[str]]:
    """The rewrite's fused calls per op, and a warning per applied rule whose kernel never ran."""
    wanted = kernel_ops(rules, names_added)
    if dispatch is None:
        return [], []
    counts: dict[str, dict[str, int]] = dispatch.get("counts") or {}
    calls = [FusedCalls(op, wanted.get(op, []), dict(paths), run) for op, paths in sorted(counts.items())]
    if not wanted:
        return calls, []
    if not dispatch.get("imported"):
        return calls, [
            f"the rewritten program never imported opadvisor.kernels: the kernels of {', '.join(sorted(wanted))} "
            "never ran"
        ]
    if not dispatch.get("record"):
        return calls, ["this opadvisor.kernels keeps no dispatch record: which implementation ran is unknown"]
    warnings = []
    for op, by in sorted(wanted.items()):
        paths = counts.get(op) or {}
        fix = f"{', '.join(by)}'s fix"
        if not paths:
            warnings.append(
                f"the rewritten program never called opadvisor.kernels.{op} ({fix}) in its {run} run: "
                "the rewrite was not exercised"
            )
        elif not paths.get("kernel"):
            ran = "; ".join(f"{n} call(s) ran {PATH_WORDS.get(p, p)}" for p, n in sorted(paths.items()))
            tail = "; the step times measure that, not the kernel" if run == "timing" else ""
            warnings.append(
                f"opadvisor.kernels.{op} ({fix}) never ran its kernel in the {run} run: {ran}{tail}"
            )
    return calls, warnings

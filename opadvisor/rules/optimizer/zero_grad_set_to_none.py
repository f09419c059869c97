"""zero_grad(set_to_none=False): every gradient filled with zeros each step instead of dropped.

What it finds
    A call `optimizer.zero_grad(set_to_none=False)` or `model.zero_grad(False)` (any spelling that passes
    False) that the profile saw zeroing gradients: one `aten::zero_` per parameter (or an
    `aten::_foreach_zero_` per device and dtype when the optimizer was built with foreach=True or
    fused=True) at the call's line, every step. The finding is at that line, with the measured time of
    the zeroing ops.

Why it is slow
    Zeroing writes every gradient in full (as many bytes as the model's parameters) and, on a GPU, launches
    a fill kernel per parameter tensor; the next backward then adds its gradient into the zeros instead of
    storing it. With `set_to_none=True` (PyTorch's default since 2.0) the gradients are dropped: no kernel,
    no write, and backward assigns each gradient as it comes. The saving counted here is the zeroing alone
    (the accumulation into zeros is not).

Example
    for x, y in loader:
        optimizer.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        optimizer.step()

Fix and its safety
    `opadvisor apply --rule zero_grad_set_to_none` removes `set_to_none=False` (or the positional False),
    leaving PyTorch's default, True. A variable (`set_to_none=flag`) is left alone, with the reason. Safe
    where every zeroed gradient gets a new one in the next backward (the profile checks it: each zeroed
    gradient's shape is among the gradients accumulated in the same step): the step then sees the same
    gradients. Unsafe, and rewritten only with --unsafe, where (a) some zeroed gradient got none (an
    unused parameter: its `.grad` becomes None, and optimizers skip a parameter without a gradient where
    they would have stepped it on zeros, momentum and weight decay included), (b) the profile cannot tell
    which gradients were zeroed (an optimizer built with foreach=True or fused=True zeroes them in one
    multi-tensor kernel on the GPU), or (c) the code uses `.grad` between zero_grad and backward (in the
    loop, after the call, before the next `.backward()`): it would see None where it saw zeros.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._findings import build_finding
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import SourceFile, load_profiled_source
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Finding

ID = "zero_grad_set_to_none"
TITLE = "zero_grad(set_to_none=False) zeroes every gradient"
FIX = "safe"
FIX_CAVEAT = (
    "unsafe where a zeroed gradient got no new one (an unused parameter) or the profile cannot tell, or where "
    ".grad is used between zero_grad and the next backward"
)

ZERO_OPS = ("aten::zero_", "aten::_foreach_zero_")
ACCUMULATE = "torch::autograd::AccumulateGrad"
OPTIMIZER_RANGE = "Optimizer.zero_grad#"  # the range torch's Optimizer.zero_grad records
GRAD_USE = re.compile(r"\.grad\b")  # `p.grad`, not `p.grad_fn` (the fix sees the same as attributes)


@dataclass
class ZeroGradFacts(Facts):
    """What the profile saw at one zero_grad call (the finding's `details`)."""

    RULES = (ID,)
    call_line: int = 0
    # gradient tensors zeroed at this call per step (0 where the profile cannot tell)
    zeroed_per_step: int = 0
    # zeroed gradients per step whose shape no gradient accumulated in the same step had: parameters that
    # got no gradient (their .grad would become None: the fix is unsafe there); None where the profile
    # cannot tell which gradients were zeroed (a foreach zeroing on the GPU is one multi-tensor kernel)
    without_gradient: int | None = 0
    # the first line using `.grad` after the call and before the next backward (None: none does): it would
    # read None there instead of zeros (the fix is unsafe there)
    grad_used_line: int | None = None


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    sites: dict[tuple[str, int], list[Op]] = defaultdict(list)
    for op in ix.forward_roots(ZERO_OPS):
        if op.file is not None and op.line is not None:
            sites[(op.file, op.line)].append(op)
    accumulated = _accumulated(ix) if sites else {}
    found = []
    for (path, line), ops in sites.items():
        src = load_profiled_source(profile, path)
        span = _zero_grad_call(profile, src, path, line)
        if span is not None:
            grad_line = _grad_use(src, span) if src is not None else None
            found.append(_finding(ix, path, span, ops, accumulated, grad_line))
    return found


def _zero_grad_call(profile: Profile, src: SourceFile | None, path: str, line: int) -> tuple[int, int] | None:
    """The statement lines of the zero_grad call at `line`, None where the line calls none: the source
    says so, or (the file changed since) torch's Optimizer.zero_grad range recorded at that line."""
    if src is not None:
        first, last = src.statement_span(line)
        return (first, last) if src.calls_named(first, last, "zero_grad") else None
    ranges = [a for a in profile.annotations if a.name.startswith(OPTIMIZER_RANGE)]
    return (line, line) if any(a.file == path and a.line == line for a in ranges) else None


def _finding(
    ix: ProfileIndex,
    path: str,
    span: tuple[int, int],
    ops: list[Op],
    accumulated: dict[int | None, Counter],
    grad_line: int | None,
) -> Finding:
    by_step: dict[int | None, list[Op]] = defaultdict(list)
    for op in ops:
        by_step[op.step].append(op)
    facts = _facts(ix, span[0], by_step, accumulated)
    facts.grad_used_line = grad_line
    total_ms = ix.per_step_ms(ix.site_cost_us(ops, backward=False))
    unsafe = facts.without_gradient != 0 or grad_line is not None
    notes = [f"{facts.zeroed_per_step} gradient tensors zeroed per step"] if facts.zeroed_per_step else []
    if facts.without_gradient is None:
        notes.append("the profile cannot tell which gradients were zeroed (one foreach kernel): unsafe")
    elif unsafe:
        notes.append(
            f"{facts.without_gradient} zeroed gradient(s) per step got no new gradient (unused parameters): "
            "with set_to_none their .grad becomes None and the optimizer skips them"
        )
    if grad_line is not None:
        notes.append(
            f"line {grad_line} uses .grad before the next backward: it would read None there, not zeros"
        )
    return build_finding(
        ix,
        rule=ID,
        fix="unsafe" if unsafe else "safe",
        path=path,
        line=span[0],
        end_line=span[1],
        occurrences=list(by_step.values()),
        head="zero_grad(set_to_none=False) fills every gradient with zeros",
        function=ops[0].function,
        fused_kernels=None,
        est_saving_ms=total_ms,
        advice="call zero_grad() with its default set_to_none=True: gradients are dropped, not zeroed",
        details=facts.to_details(),
        notes=notes,
        backward=False,
    )


def _grad_use(src: SourceFile, span: tuple[int, int]) -> int | None:
    """The first line using `.grad` after the call at `span` and before the next backward, in the call's
    innermost loop (else its function, else the file): `grad_use_before_backward` on the source's lines."""
    loop = src.enclosing_loop(span[0])
    function = src.enclosing_function(span[0])
    first, last = loop or ((function.line, function.end_line) if function else (1, len(src.lines)))
    backwards = [c.line for c in src.calls(first, last) if c.attr == "backward"]
    grads = [i for i in range(first, last + 1) if GRAD_USE.search(src.line_text(i).partition("#")[0])]
    return grad_use_before_backward(span[1], loop is not None, backwards, grads)


def grad_use_before_backward(
    here: int, loop: bool, backwards: Sequence[int], grads: Sequence[int]
) -> int | None:
    """The first of the lines `grads` (lines using `.grad`) that runs after line `here` (the zero_grad call)
    and before the next of the lines `backwards` (`.backward(...)` calls); in a loop the body wraps round
    to its start. None when there is none. The rule and its fix both decide with this."""
    grads = sorted(grads)
    after = sorted(b for b in backwards if b > here)
    if after:
        return next((g for g in grads if here < g < after[0]), None)
    later = [g for g in grads if g > here]
    if later or not loop:
        return later[0] if later else None
    stop = min(backwards) if backwards else here  # the loop's next pass, up to its first backward
    return next((g for g in grads if g < stop), None)


def _accumulated(ix: ProfileIndex) -> dict[int | None, Counter]:
    """Per step, the shapes of the gradients backward accumulated into parameters (a multiset)."""
    found: dict[int | None, Counter] = defaultdict(Counter)
    for op in ix.profile.ops:
        if op.name == ACCUMULATE and op.is_backward and ix.in_window(op):
            found[op.step][_shape(op)] += 1
    return found


def _facts(
    ix: ProfileIndex, line: int, by_step: dict[int | None, list[Op]], accumulated: dict[int | None, Counter]
) -> ZeroGradFacts:
    """The call's facts: how many gradients it zeroed a step, and how many of them got no new one in the
    same step (a multiset difference of shapes: two unused [64, 64] weights beside one used count as one)."""
    zeroed: dict[int | None, Counter] = {}
    for step, ops in by_step.items():
        shapes = [_zeroed_shapes(ix, op) for op in ops]
        if any(s is None for s in shapes):
            return ZeroGradFacts(call_line=line, zeroed_per_step=0, without_gradient=None)
        zeroed[step] = Counter(shape for some in shapes for shape in some or ())
    return ZeroGradFacts(
        call_line=line,
        zeroed_per_step=round(sum(c.total() for c in zeroed.values()) / ix.steps_recorded),
        without_gradient=max((c - accumulated.get(step, Counter())).total() for step, c in zeroed.items()),
    )


def _zeroed_shapes(ix: ProfileIndex, op: Op) -> list[tuple[int, ...] | None] | None:
    """The shapes of the gradients one zeroing op zeroed; None where the profile cannot tell: a foreach
    zeroing records its per-tensor `zero_` ops on the CPU, on the GPU one multi-tensor kernel."""
    if op.name == "aten::zero_":
        return [_shape(op)]
    return [_shape(d) for d in ix.descendants(op) if d.name == "aten::zero_"] or None


def _shape(op: Op) -> tuple[int, ...] | None:
    first = op.input_shapes[0] if op.input_shapes else None
    return tuple(first) if isinstance(first, list) else None


__all__ = ["FIX", "FIX_CAVEAT", "ID", "TITLE", "ZeroGradFacts", "detect", "grad_use_before_backward"]

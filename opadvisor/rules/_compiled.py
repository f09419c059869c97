"""How much of the step ran inside torch.compile graphs, which the rules cannot see into.

Ops that run inside a compiled graph have no Python frame of the user's code around them (inductor's
kernels, or the graph's own aten calls), so no rule can tie them to a source line. The profile shows each
graph call as one op: `Torch-Compiled Region: <frame>/<recompile>` forward and, for training,
`CompiledFunctionBackward` run by autograd. `compiled_regions(profile)` sums their time:

    {"ms_per_step": 41.2, "share_of_step": 0.72, "basis": "cpu" | "gpu", "graphs": 2}

or None when nothing ran compiled. `opadvisor profile --eager` switches torch.compile off for the run, so
the same code is recorded op by op and its patterns can be found and fixed.
"""

from __future__ import annotations

from typing import Any

from opadvisor.profile.model import Profile
from opadvisor.rules._index import index_of

FORWARD_PREFIX = "Torch-Compiled Region"
BACKWARD_SUFFIX = "CompiledFunctionBackward"


def compiled_regions(profile: Profile) -> dict[str, Any] | None:
    ix = index_of(profile)
    regions = [
        op
        for op in profile.ops
        if op.parent is None
        and ix.in_window(op)
        and (op.name.startswith(FORWARD_PREFIX) or op.is_backward and op.name.endswith(BACKWARD_SUFFIX))
    ]
    if not regions:
        return None
    ms = ix.per_step_ms(sum(ix.cost_us(op) for op in regions))
    if ix.gpu:
        spans = [s.gpu_span_ms or s.wall_ms for s in profile.steps]
        step = sum(spans) / len(spans) if spans else None
    else:
        step = ix.step_ms
    return {
        "ms_per_step": round(ms, 4),
        "share_of_step": round(min(1.0, ms / step), 4) if step else None,
        "basis": ix.basis,
        "graphs": len({op.name for op in regions if op.name.startswith(FORWARD_PREFIX)}),
    }

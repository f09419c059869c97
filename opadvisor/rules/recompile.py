"""torch.compile compiles the same code again: recompiles, their cause and the time they cost.

What it finds
    In a script that compiles its model or step, every compiled function that dynamo compiled more than
    once, grouped by the guard that failed, recorded while the script ran (profiled without `--eager`): a
    tensor input whose size changed (a sequence length or batch that varies from step to step), a Python
    number argument that changed (a learning rate, a temperature, a step counter passed as a float or int),
    a dtype that changed, a module whose `training` flag flipped; and a function whose recompile limit was
    reached, which dynamo then runs eagerly for good. Compile time itself is in the summary (the first
    steps against the steady state).

Why it is slow
    A recompile runs dynamo and the backend compiler again, seconds each for a model (the first compile's
    time, again); a function that reaches its recompile limit (8 by default) runs uncompiled for the rest of
    the run, losing every speed-up. The cost shown is the compile time the recompiles took, spread over the
    run's steps so far, and the step time of the eager fallback where the limit was hit.

Example
    model = torch.compile(model)
    for batch in loader:                    # sequences of varying length, no padding to a fixed size
        loss = model(batch["input_ids"])    # recompiles for each new length until dims turn dynamic

Fix and its safety
    `opadvisor apply --rule recompile`: a changing size gets `dynamic=True` on the `torch.compile(...)` call
    (one graph for every length; safe, the same values). A Python number that changes every step should be
    passed as a 0-d tensor, and a train/eval flip compiled once per mode; those are advice. Where the
    shapes are few, padding the batch to a few bucket sizes keeps static shapes (advice).
"""

from __future__ import annotations

from opadvisor.rules.compile_facts import RecompileFacts

ID = "recompile"
TITLE = "torch.compile recompiles the same code"
FIX = "safe"
FIX_CAVEAT = "none for recompiles on a changing number, dtype or training flag (advice)"

__all__ = ["FIX", "FIX_CAVEAT", "ID", "RecompileFacts", "TITLE", "detect"]


def detect(profile):  # filled in with the compile recorder (issue 33)
    from opadvisor.rules.engine import NotApplicable

    raise NotApplicable("not recorded yet")

"""torch.compile splits the compiled code at a line it cannot trace: a graph break, with its cost per step.

What it finds
    In a script that compiles its model or step (`torch.compile(model)`, `model.compile()`,
    `@torch.compile`), every place where dynamo stopped tracing and split the compiled code into several
    graphs, at the user's line, with dynamo's own reason, recorded while the script ran (profiled without
    `--eager`). The causes it names: a tensor read as a Python number (`.item()`, `float(t)`, `.tolist()`),
    a `print` of a tensor, Python control flow on a tensor's value (`if loss > 0:`), and a call dynamo cannot
    trace (a C extension, numpy on tensors); any other reason is shown as dynamo words it. Each break is
    reported once, however many times it recompiled.

Why it is slow
    Each break ends one graph and starts another: the code around it runs eagerly op by op in Python, the
    compiler cannot fuse across it (two half-graphs launch more kernels than one), every graph has its own
    guards to check and its own launch on every call, and a read of a tensor's value makes the host wait
    for the GPU. The cost shown is what the profile measured at the break per step: the ops that ran
    eagerly at its line and the time spent entering and leaving the extra graph (plus, on a GPU profile, the
    GPU's idle time between the two graphs).

Example
    class Model(nn.Module):
        def forward(self, x):
            y = self.body(x)
            print(y.mean())                 # print of a tensor: break
            if y.max() > 0:                 # control flow on a tensor's value: break
                y = y * 2
            return y
    model = torch.compile(model)

Fix and its safety
    `opadvisor apply --rule graph_break` rewrites at the line, each fix computing the same values:
    a `print` of a tensor is made reorderable (`torch._dynamo.config.reorderable_logging_functions.add(print)`:
    dynamo moves the print after the graph, which prints the same values); a `.item()` whose number only
    feeds tensor arithmetic keeps the tensor (`.detach()`), otherwise dynamo is told to trace scalar reads
    (`torch._dynamo.config.capture_scalar_outputs = True`); an `if` on a tensor whose branches each assign
    one tensor expression to the same name becomes `torch.where(cond, a, b)` (both branches are then
    computed; safe for pure expressions, not where a branch would produce inf or nan that the `if` avoided:
    its gradient then reaches the other branch); an untraceable call gets `@torch.compiler.disable` on the
    smallest user function around it (not on the compiled function itself). Other breaks get advice only.
    `opadvisor verify` then compares losses and step times; compile with `fullgraph=True` to be told of any
    break left.
"""

from __future__ import annotations

from opadvisor.rules.compile_facts import GraphBreakFacts

ID = "graph_break"
TITLE = "torch.compile graph breaks at the user's line"
FIX = "safe"
FIX_CAVEAT = "none for breaks other than scalar reads, prints, tensor branches and untraceable calls"

__all__ = ["FIX", "FIX_CAVEAT", "GraphBreakFacts", "ID", "TITLE", "detect"]


def detect(profile):  # filled in with the compile recorder (issue 33)
    from opadvisor.rules.engine import NotApplicable

    raise NotApplicable("not recorded yet")

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
    `opadvisor verify` then compares losses and step times, and a new profile shows any break left.
    (`fullgraph=True` raises on most breaks, but not on every one: torch traces `.item()` itself under
    fullgraph, and a function marked `@torch.compiler.disable` is still a break there.)
"""

from __future__ import annotations

from collections import defaultdict

from opadvisor.profile.model import CompiledFrame, Profile
from opadvisor.rules._compiled import (
    break_kind,
    compile_call_for,
    compiled_function_of,
    graphs_per_step,
    resumed_frame_ids,
    site_host_us,
    user_frames,
)
from opadvisor.rules._findings import cost_words, fmt_ms
from opadvisor.rules._index import index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.compile_facts import GraphBreakFacts
from opadvisor.rules.engine import NotApplicable
from opadvisor.rules.finding import Evidence, Finding

ID = "graph_break"
TITLE = "torch.compile graph breaks at the user's line"
FIX = "safe"
FIX_CAVEAT = "none for breaks other than scalar reads, prints, tensor branches and untraceable calls"

FIXABLE = frozenset({"scalar_read", "print", "tensor_branch", "unsupported_call"})
KIND_WORDS = {
    "scalar_read": "a tensor read as a Python number",
    "print": "a print of a tensor",
    "tensor_branch": "Python control flow on a tensor's value",
    "unsupported_call": "a call dynamo cannot trace",
    "other": "dynamo stopped tracing",
}
ADVICE = {
    "scalar_read": "keep the value a tensor (drop `.item()` where it only feeds tensor math) or set "
    "`torch._dynamo.config.capture_scalar_outputs = True`",
    "print": "print outside the compiled code, or let dynamo move it after the graph: "
    "`torch._dynamo.config.reorderable_logging_functions.add(print)`",
    "tensor_branch": "compute both branches and select with `torch.where(cond, a, b)` (or `torch.cond` for "
    "branches that differ in more than a value)",
    "unsupported_call": "put the call in a small function marked `@torch.compiler.disable`, or use the torch "
    "equivalent",
    "other": "see dynamo's reason; `TORCH_LOGS=graph_breaks` prints the stack",
}


def detect(profile: Profile) -> list[Finding]:
    frames = user_frames(profile)
    if not profile.compiled_frames:
        raise NotApplicable(
            "nothing was compiled with torch.compile in this run"
            + (" (profiled with --eager)" if profile.eager else "")
        )
    sites: dict[tuple[str, int], list[CompiledFrame]] = defaultdict(list)
    for frame in frames:
        if frame.break_file in profile.sources and frame.break_line is not None:
            sites[(frame.break_file, frame.break_line)].append(frame)
    return [_finding(profile, path, line, broke) for (path, line), broke in sorted(sites.items())]


def _finding(profile: Profile, path: str, line: int, broke: list[CompiledFrame]) -> Finding:
    ix = index_of(profile)
    first = broke[0]
    kind = break_kind(first.break_reason or "", first.break_explanation or "")
    eager_us, overhead_us = site_host_us(profile, path, line, resumed_frame_ids(profile, path, line))
    ms = ix.per_step_ms(eager_us + overhead_us)
    share = ix.share_of_step(ms)
    graphs = graphs_per_step(profile)
    compiled_fn, compiled_line = compiled_function_of(profile, first)
    call = compile_call_for(profile, first.file, compiled_line)
    src = load_profiled_source(profile, path)
    start, end = src.statement_span(line) if src is not None else (line, line)
    if kind == "tensor_branch" and src is not None:
        start, end = src.if_statement(start) or (start, end)  # its fix rewrites the whole if
    fn = src.enclosing_function(line) if src is not None else None
    fn_name, fn_line = (fn.qualname, fn.line) if fn is not None else (None, None)
    facts = GraphBreakFacts(
        kind=kind,
        reason=first.break_reason or "",
        line=line,
        function=fn_name,
        function_line=fn_line,
        compiled_function=compiled_fn,
        compiled_line=compiled_line,
        graphs_per_step=graphs,
        compile_file=call.file if call is not None else None,
        compile_line=call.line if call is not None else None,
    )
    graphs_words = f"; {graphs:.0f} compiled graphs run per step" if graphs else ""
    message = (
        f"graph break: {KIND_WORDS[kind]} splits the compiled {compiled_fn or 'code'}"
        f"{graphs_words}; {cost_words(ix, ms, share)} at the break"
    )
    return Finding(
        rule=ID,
        path=path,
        line=start,
        end_line=end,
        message=message,
        fix="safe" if kind in FIXABLE else "none",
        function=fn_name,
        evidence=Evidence(
            ops=[],
            time_ms_per_step=ms,
            share_of_step=share,
            time_basis="cpu",
            notes=[
                f"dynamo: {first.break_reason}"
                + (f" ({first.break_explanation})" if first.break_explanation else ""),
                f"host time per step: {fmt_ms(ix.per_step_ms(eager_us))} in the ops run eagerly at the line, "
                f"{fmt_ms(ix.per_step_ms(overhead_us))} entering and leaving the graph resumed after it; "
                "the fusion lost across the break is not in this number",
                f"compiled {len(broke)}x with this break (recompiles included)",
            ],
        ),
        time_ms_per_step=ms,
        est_saving_ms_per_step=ms,
        advice=ADVICE[kind],
        details=facts.to_details(),
    )


__all__ = ["FIX", "FIX_CAVEAT", "GraphBreakFacts", "ID", "TITLE", "detect"]

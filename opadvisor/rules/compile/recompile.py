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
    run's steps so far; where the limit was hit the finding says so (the time lost running eagerly is in
    the step, not in that number).

Example
    model = torch.compile(model)
    for batch in loader:                    # sequences of varying length, no padding to a fixed size
        loss = model(batch["input_ids"])    # recompiles for each new length until dims turn dynamic

Fix and its safety
    `opadvisor apply --rule recompile`: a changing size, or a Python number (int or float) that changes,
    gets `dynamic=True` on the `torch.compile(...)` call (one graph for every length or value: dynamo
    traces sizes and numbers as symbols; safe, the same values). Passing a changing number as a 0-d tensor
    does the same by hand; a train/eval flip is compiled once per mode (advice). Where the shapes are few,
    padding the batch to a few bucket sizes keeps static shapes (advice).
"""

from __future__ import annotations

import re
from collections import defaultdict

from opadvisor.profile.model import CompiledFrame, Profile
from opadvisor.rules._compiled import compile_call_for, original_function, user_frames
from opadvisor.rules._findings import cost_words, fmt_ms
from opadvisor.rules._index import index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.compile_facts import RecompileFacts
from opadvisor.rules.engine import NotApplicable
from opadvisor.rules.finding import Evidence, Finding

ID = "recompile"
TITLE = "torch.compile recompiles the same code"
FIX = "safe"
FIX_CAVEAT = "none for recompiles on a changing number, dtype or training flag (advice)"

# dynamo's guard failures, as `format_guard_failures` words them ("1/0: tensor 'ids' size mismatch at
# index 1. expected 16, actual 17"; "L['lr'] == 0.001"; "___check_obj_id(...training...)")
_SIZE = re.compile(r"tensor '([^']+)' (?:size|stride) mismatch at index (\d+)\. expected (\S+), actual (\S+)")
_DTYPE = re.compile(r"tensor '([^']+)' dtype mismatch")
_VALUE = re.compile(r"^(?:L\['([^']+)'\]|([A-Za-z_][\w.]*)) == ([^\s,)#]+)")
_CACHE_LIMIT = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")
ADVICE = {
    "shape": "compile with `dynamic=True` (one graph for every size), mark the dimension dynamic "
    "(`torch._dynamo.mark_dynamic(x, dim)`), or pad batches to a few fixed sizes",
    "scalar": "compile with `dynamic=True` (dynamo traces the number as a symbol), or pass it as a 0-d tensor "
    "(`torch.tensor(lr)`), which dynamo does not specialise on",
    "dtype": "keep the input's dtype the same every call (cast before the compiled call)",
    "training": "keep one mode per compiled model (compile a separate one for evaluation), or accept one "
    "compile per mode",
    "other": "see dynamo's reason; `TORCH_LOGS=recompiles` prints each guard that failed",
}


def detect(profile: Profile) -> list[Finding]:
    if not profile.compiled_frames:
        raise NotApplicable(
            "nothing was compiled with torch.compile in this run"
            + (" (profiled with --eager)" if profile.eager else "")
        )
    groups: dict[tuple[str, str, str], list[CompiledFrame]] = defaultdict(list)
    firsts: dict[tuple[str, str], CompiledFrame] = {}
    for frame in user_frames(profile):
        name = original_function(frame.function)
        if name == frame.function:
            firsts.setdefault((frame.file or "", name), frame)
        if frame.recompile_reasons or _limit_hit(frame):
            groups[(frame.file or "", name, _kind(frame))].append(frame)
    findings = []
    for (file, name, kind), frames in groups.items():
        first = firsts.get((file, name))
        finding = _finding(profile, file, name, kind, frames, first)
        if finding is not None:
            findings.append(finding)
    return findings


def _limit_hit(frame: CompiledFrame) -> bool:
    return bool(frame.failed) and any(w in frame.failed.lower() for w in _CACHE_LIMIT)


def _kind(frame: CompiledFrame) -> str:
    guards = [_guard_words(r) for r in frame.recompile_reasons]
    if any(_SIZE.search(g) for g in guards):
        return "shape"
    if any(_DTYPE.search(g) for g in guards):
        return "dtype"
    if any("training" in g for g in guards):
        return "training"
    if any(_VALUE.search(g) for g in guards):
        return "scalar"
    return "other"


def _guard_words(reason: str) -> str:
    """A guard failure without its compile id, the source comment and stack torch appends to it:
    "0/0: temperature == 1.0   # return x / temperature  # train.py:7 ..." -> "temperature == 1.0"."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    first = re.sub(r"^\d+/\d+: ", "", first)
    return first.split("  #", 1)[0].split(" # ", 1)[0].strip()


def _recompiles(frames: list[CompiledFrame]) -> int:
    """How many times the function was compiled again: the frames resumed after its breaks recompile
    with it (one event, several frames), so its compiles per frame, at most."""
    per_frame: dict[str, int] = defaultdict(int)
    for f in frames:
        if f.recompile_reasons:
            per_frame[f.frame_id] += 1
    return max(per_frame.values(), default=0)


def _facts(kind: str, frames: list[CompiledFrame], first: CompiledFrame | None) -> RecompileFacts:
    reasons = list(dict.fromkeys(_guard_words(r) for f in frames for r in f.recompile_reasons))
    facts = RecompileFacts(
        kind=kind,
        reasons=reasons[:8],
        function=first.function if first else original_function(frames[0].function),
        function_line=first.line if first else None,
        file=frames[0].file,
        recompiles=_recompiles(frames),
        compile_s=round(sum(f.compile_s or 0.0 for f in frames), 4),
        cache_limit_hit=any(_limit_hit(f) for f in frames),
    )
    size = next((m for r in reasons if (m := _SIZE.search(r))), None)
    value = next((m for r in reasons if (m := _VALUE.search(r))), None)
    if kind == "shape" and size is not None:
        facts.input, facts.dim = size.group(1), int(size.group(2))
        seen = [
            v for r in reasons if (m := _SIZE.search(r)) and m.group(1) == facts.input for v in m.group(3, 4)
        ]
        facts.values = list(dict.fromkeys(seen))
    elif kind == "scalar" and value is not None:
        facts.input = value.group(1) or value.group(2)
        facts.values = list(dict.fromkeys(m.group(3) for r in reasons if (m := _VALUE.search(r))))
    return facts


def _finding(
    profile: Profile,
    file: str,
    name: str,
    kind: str,
    frames: list[CompiledFrame],
    first: CompiledFrame | None,
) -> Finding | None:
    ix = index_of(profile)
    facts = _facts(kind, frames, first)
    call = compile_call_for(profile, file, facts.function_line)
    if call is not None:
        facts.compile_file, facts.compile_line = call.file, call.line
        facts.compile_kwargs = {
            k: str(v) for k, v in call.attrs.items() if k not in ("target", "code_file", "code_line")
        }
    path, line = (call.file, call.line) if call is not None and call.file else (file, facts.function_line)
    if not path or line is None:
        return None
    src = load_profiled_source(profile, path)
    start, end = src.statement_span(line) if src is not None else (line, line)
    steps = max(profile.steps_seen, len(profile.steps), 1)
    ms = facts.compile_s * 1000.0 / steps
    share = ix.share_of_step(ms)
    fixable = kind in ("shape", "scalar") and call is not None and "dynamic" not in facts.compile_kwargs
    what = {
        "shape": f"the size of `{facts.input}` (dim {facts.dim}) changed: {', '.join(facts.values[:6])}",
        "scalar": f"the number `{facts.input}` changed (compiled for {', '.join(facts.values[:6])} before)",
        "dtype": "an input's dtype changed",
        "training": "a module's training flag flipped",
        "other": facts.reasons[0] if facts.reasons else "a guard failed",
    }[kind]
    limit = "; it reached the recompile limit and now runs eagerly" if facts.cache_limit_hit else ""
    message = (
        f"torch.compile recompiled {name} {facts.recompiles}x: {what}{limit}; "
        f"{facts.compile_s:.2f} s of compiling, {cost_words(ix, ms, share)} over the run's {steps} steps"
    )
    return Finding(
        rule=ID,
        path=path,
        line=start,
        end_line=end,
        message=message,
        fix="safe" if fixable else "none",
        function=name,
        evidence=Evidence(
            time_ms_per_step=ms,
            share_of_step=share,
            time_basis="cpu",
            occurrences=facts.recompiles,
            notes=[f"dynamo: {r}" for r in facts.reasons[:4]]
            + [f"compile time spread over the {steps} steps run so far: {fmt_ms(ms)}/step"],
        ),
        time_ms_per_step=ms,
        est_saving_ms_per_step=ms,
        advice=ADVICE[kind],
        details=facts.to_details(),
    )


__all__ = ["FIX", "FIX_CAVEAT", "ID", "RecompileFacts", "TITLE", "detect"]

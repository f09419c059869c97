"""torch.compile compiles a model of repeated blocks whole: compile one block for all (regional compilation).

What it finds
    In a script that compiles its model whole (`torch.compile(model)`, `model.compile()`), recorded while
    the script ran (profiled without `--eager`): a model built as a stack of identical blocks (a
    transformer's layers: `nn.ModuleList([Block(...) for _ in range(n)])`, a HuggingFace model's
    `model.layers`, timm's `blocks`), with the seconds torch.compile spent compiling it in the run. The
    block class is recorded at the `torch.compile` call from the model itself: the class with two or more
    instances (its own submodules, not one of torch's) holding the largest share of the model's parameters.
    Not reported where the blocks differ in a Python number (an int, float or bool attribute of the block or
    its submodules): dynamo compiles once per distinct value, so blocks numbered by a `layer_idx` (every
    transformers model: it indexes the cache) or given per-block stochastic-depth rates would recompile for
    each block and, past dynamo's recompile limit, run eagerly. Up to 4 distinct sets are accepted.

Why it is slow
    Compiled whole, dynamo traces every block again and the backend compiles the unrolled graph: the
    compile time grows with the depth (tens of seconds to minutes for a base-size model, on every start and
    after every recompile). Each block compiled on its own reuses one compiled graph for every instance
    (dynamo treats the blocks' parameters as inputs), so the compile takes about one block's time. The
    cost shown is the compile time of the run spread over the steps run so far (it is paid once per start;
    a long run spreads it thinner); the saving, an estimate: all but one block's share of it.

Example
    model = GPT(n_layer=12)                 # self.blocks = nn.ModuleList([Block(c) for _ in range(12)])
    model = torch.compile(model)            # every step's first call traces and compiles all 12 blocks

Fix and its safety
    `opadvisor apply --rule regional_compile` replaces the whole-model compile with a compile of each block,
    with the same keyword arguments:

        for block in model.blocks:
            block.compile()

    (a name bound to the compiled model is bound to the model itself). Safe: the same values. The modules
    outside the blocks (the embedding, the head, the loss) then run eagerly, the compiler no longer fuses
    across block boundaries, and each block's compiled call checks its guards and runs its wrappers on the
    host, forward and backward: on a GPU-bound step a small share (a GPT-2-sized model on an H200: no
    change measurable), on a tiny host-bound one not (tests/rules/scripts/compiled_blocks.py on a 2-core CPU:
    about 5 -> 18 ms a step, 1 ms per compiled call). `opadvisor verify` measures the step time, and
    `opadvisor profile` again shows the compile time.
"""

from __future__ import annotations

from typing import Any

from opadvisor.profile.model import CompiledFrame, Construction, Profile
from opadvisor.rules._compiled import compiled_function_of
from opadvisor.rules._findings import cost_words, fmt_ms
from opadvisor.rules._index import index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.compile_facts import RegionalCompileFacts
from opadvisor.rules.engine import NotApplicable
from opadvisor.rules.finding import Evidence, Finding

ID = "regional_compile"
TITLE = "a model of repeated blocks compiled whole"
FIX = "safe"
FIX_CAVEAT = "the modules outside the blocks then run eagerly (verify measures the step)"

MIN_COMPILE_S = 0.5  # below this, compiling whole costs too little to be worth a change
MIN_SCORE = 0.4  # the blocks' parameter share less what still compiles: 2 like blocks of the model score 0.5
MAX_VARIANTS = 4  # blocks compiling to more graphs than this: past dynamo's recompile limit (8), soon


def detect(profile: Profile) -> list[Finding]:
    if not profile.compiled_frames:
        raise NotApplicable(
            "nothing was compiled with torch.compile in this run"
            + (" (profiled with --eager)" if profile.eager else "")
        )
    calls = [c for c in profile.constructions if c.kind == "compile" and c.file in profile.sources]
    findings = []
    for call in calls:
        blocks = call.attrs.get("blocks")
        if not isinstance(blocks, dict) or not _worth_it(blocks):
            continue
        frames = _frames_of(profile, call, len(calls))
        finding = _finding(profile, call, _facts(call, blocks, frames))
        if finding is not None:
            findings.append(finding)
    return findings


def _worth_it(blocks: dict[str, Any]) -> bool:
    """Blocks that compile to few graphs (a number attribute that differs per block, such as a transformers
    layer's `layer_idx`, makes one graph per block: measured on an H200, a transformers Llama's 12 layers
    recompiled 8 times, hit dynamo's limit and ran 2x slower than the whole-model compile)."""
    count = int(blocks.get("count") or 0)
    share = blocks.get("param_share") or 0.0
    variants = int(blocks.get("variants") or 1)
    return count >= 2 and variants <= MAX_VARIANTS and share * (1.0 - variants / count) >= MIN_SCORE


def _frames_of(profile: Profile, call: Construction, calls: int) -> list[CompiledFrame]:
    """The frames dynamo compiled for this call: every frame where the run compiled one thing (a
    library's model has its frames in the library's files), else those of the compiled code."""
    if calls == 1:
        return list(profile.compiled_frames)
    file, line = call.attrs.get("code_file"), call.attrs.get("code_line")
    return [
        f for f in profile.compiled_frames if f.file == file and compiled_function_of(profile, f)[1] == line
    ]


def _facts(call: Construction, blocks: dict[str, Any], frames: list[CompiledFrame]) -> RegionalCompileFacts:
    return RegionalCompileFacts(
        model=str(call.attrs.get("target") or "").rpartition(".forward")[0] or "the model",
        block=str(blocks.get("cls") or ""),
        block_qualified=str(blocks.get("qualified") or ""),
        count=int(blocks.get("count") or 0),
        containers=list(blocks.get("containers") or []),
        singles=list(blocks.get("singles") or []),
        param_share=blocks.get("param_share"),
        variants=int(blocks.get("variants") or 1),
        differs=list(blocks.get("differs") or []),
        outside=list(blocks.get("outside") or []),
        compile_s=round(sum(f.compile_s or 0.0 for f in frames), 4),
        compile_s_first_step=round(sum(f.compile_s or 0.0 for f in frames if f.step == 0), 4),
        compile_file=call.file,
        compile_line=call.line,
        compile_kwargs={
            k: str(v)
            for k, v in call.attrs.items()
            if k not in ("target", "code_file", "code_line", "blocks")
        },
    )


def _finding(profile: Profile, call: Construction, facts: RegionalCompileFacts) -> Finding | None:
    if facts.compile_s < MIN_COMPILE_S or not call.file or call.line is None:
        return None
    ix = index_of(profile)
    src = load_profiled_source(profile, call.file)
    start, end = src.statement_span(call.line) if src is not None else (call.line, call.line)
    steps = max(profile.steps_seen, len(profile.steps), 1)
    ms = facts.compile_s * 1000.0 / steps
    share = facts.param_share or 0.0
    saving = ms * share * (1.0 - facts.variants / facts.count)
    where = ", ".join([*facts.containers, *facts.singles][:3])
    outside = f" ({', '.join(facts.outside[:4])} then run eagerly)" if facts.outside else ""
    message = (
        f"torch.compile compiles {facts.model} whole: {facts.compile_s:.2f} s of compiling for "
        f"{facts.count} {facts.block} blocks ({share:.0%} of its parameters, in {where}); compiling one "
        f"block for all{outside} saves most of it; {cost_words(ix, ms, ix.share_of_step(ms))} over the run's "
        f"{steps} steps"
    )
    return Finding(
        rule=ID,
        path=call.file,
        line=start,
        end_line=end,
        message=message,
        fix="safe",
        function=facts.model,
        evidence=Evidence(
            time_ms_per_step=ms,
            share_of_step=ix.share_of_step(ms),
            time_basis="cpu",
            occurrences=facts.count,
            notes=[
                f"compile time: {facts.compile_s:.2f} s in the run, {facts.compile_s_first_step:.2f} s in the "
                f"first step; spread over the {steps} steps run so far: {fmt_ms(ms)}/step",
                f"estimate: {facts.variants} {facts.block} graph(s) compiled for all {facts.count} save about "
                f"{share:.0%} x (1 - {facts.variants}/{facts.count}) of it ({fmt_ms(saving)}/step)"
                + (f"; the blocks differ in {', '.join(facts.differs[:3])}" if facts.differs else ""),
            ],
        ),
        time_ms_per_step=ms,
        est_saving_ms_per_step=saving,
        advice=f"compile each {facts.block} on its own (`for block in model.{where.split(', ')[0]}: "
        "block.compile()`) instead of the whole model",
        details=facts.to_details(),
    )


__all__ = ["FIX", "FIX_CAVEAT", "ID", "TITLE", "RegionalCompileFacts", "detect"]

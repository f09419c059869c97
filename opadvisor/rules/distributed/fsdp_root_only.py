"""FSDP2 with one fully_shard on the root of a model of repeated blocks: the whole model is one unit.

What it finds
    A `fully_shard(model)` call (recorded at the user's line) on the module whose forward the script calls,
    with no unit inside it, holding a model whose repeated blocks (a transformer's layers, found as
    `regional_compile` finds them) carry most of its parameters.

Why it is slow
    FSDP gathers, reshards and reduce-scatters per unit. One unit for the whole model means the forward
    waits for the all-gather of every parameter before its first op (nothing to overlap it with), the
    backward waits likewise, and every gradient is reduce-scattered after the whole backward: the
    communication is exposed. It also holds the whole unsharded model in memory during forward and
    backward, which is what sharding was meant to avoid. With one unit per block, FSDP2 prefetches the next
    block's all-gather while the current block computes, and reduce-scatters each block's gradients while
    the backward goes on. The cost shown is the measured communication per step (cross_rank's numbers:
    NCCL kernels on a GPU, gloo's ranges on a CPU). No saving is claimed, and `apply` does not make this
    change by itself: measured on 2 H200s (NVLink) with a GPT-2-medium-sized model (24 blocks, 406M
    parameters, 4 micro-steps of 8x1024 tokens), one unit per block made the step 2.5x *slower*
    (250 -> 617 ms; with reshard_after_forward=False on the blocks 284 -> 442 ms): at that size two
    ranks gain less from overlap than 24 units cost in collectives and hooks. What a unit per block
    buys for certain is memory (the unsharded model is never whole); where memory is what limits the
    batch or the model, make the change and measure it (`opadvisor verify` times both programs).

Example
    model = GPT(n_layer=24)
    fully_shard(model)

Fix
    Advice, not applied (see above): a loop before the call that shards each block with the call's own
    keyword arguments, which `opadvisor apply --rule fsdp_root_only` writes when asked by name (never
    `--rule all`):

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    It would be safe: the same parameters, the same sums (FSDP's reductions grouped per block).
"""

from __future__ import annotations

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules.distributed._parallel import comm_of, constructions, finding_at, unit_notes
from opadvisor.rules.distributed.parallel_facts import FsdpFacts
from opadvisor.rules.finding import Finding

ID = "fsdp_root_only"
TITLE = "one FSDP unit for a model of repeated blocks"
FIX = "none"  # measured slower on 2 GPUs: advice (module docstring)

MIN_BLOCK_SHARE = 0.5  # the blocks hold at least this share of the model's parameter tensors
MIN_OWN_SHARE = 0.5  # the root unit owns at least this share of the model's parameters


def detect(profile: Profile) -> list[Finding]:
    findings = []
    for c in constructions(profile, "fsdp"):
        a = c.attrs
        blocks = a.get("blocks")
        if not a.get("root") or a.get("units_inside") or not isinstance(blocks, dict):
            continue
        own, total = int(a.get("own_params") or 0), int(a.get("module_params") or 0)
        if total <= 0 or own / total < MIN_OWN_SHARE or int(blocks.get("count") or 0) < 2:
            continue
        if (blocks.get("param_share") or 0.0) < MIN_BLOCK_SHARE:
            continue
        findings.append(_finding(profile, c, blocks))
    return findings


def _finding(profile: Profile, c: Construction, blocks: dict) -> Finding:
    a = c.attrs
    comm = comm_of(profile)
    per_unit, unit_words = unit_notes(profile)
    count = int(blocks["count"])
    time_ms = comm.total_ms if comm is not None and comm.total_ms > 0 else None
    where = ", ".join([*blocks.get("containers", []), *blocks.get("singles", [])][:3])
    measured = (
        f"all-gather {fmt_ms(comm.of('all_gather'))}/step, communication {comm.words()}"
        if time_ms is not None and comm is not None
        else "no collective was recorded in the window"
    )
    facts = FsdpFacts(
        construction_line=c.line,
        module=c.module,
        own_params=int(a.get("own_params") or 0),
        module_params=int(a.get("module_params") or 0),
        units_inside=0,
        block=str(blocks.get("cls") or ""),
        count=count,
        containers=list(blocks.get("containers") or []),
        singles=list(blocks.get("singles") or []),
        param_share=blocks.get("param_share"),
        given=list(a.get("given") or []),
        units=per_unit,
    )
    finding = finding_at(
        profile,
        c,
        ID,
        message=f"one fully_shard unit holds the whole model ({a.get('own_params'):,} parameters, {count} "
        f"{facts.block} blocks in {where}): every step gathers all of it before the forward and nothing "
        f"overlaps; {measured}",
        fix="none",
        time_ms=time_ms,
        saving_ms=None,
        comm=comm,
        notes=[
            "one unit holds the whole unsharded model in memory in forward and backward: one unit per block "
            "does not, which is what it surely buys",
            f"not applied by apply: one unit per {facts.block} prefetches the next block's all-gather during the "
            "current one, but measured on 2 H200s (GPT-2-medium size) it made the step 2.5x slower; change it "
            "where memory limits you, and time it with opadvisor verify",
            *unit_words,
        ],
        advice=f"where memory limits the batch or the model: call fully_shard on each {facts.block} before the root "
        f"(`for block in model.{where.split(', ')[0]}: fully_shard(block)`; `opadvisor apply --rule fsdp_root_only` "
        "writes it), then time both with opadvisor verify",
        details=facts.to_details(),
    )
    # its codemod runs when the rule is named (`apply --rule fsdp_root_only`), never in `--rule all`
    finding.on_request = True
    return finding


__all__ = ["FIX", "ID", "TITLE", "detect"]

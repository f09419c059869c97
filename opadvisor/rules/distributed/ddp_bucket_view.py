"""DistributedDataParallel copying every reduced gradient out of its bucket into `.grad` each step.

What it finds
    A `DistributedDataParallel(...)` construction (recorded at the user's line) built without
    `gradient_as_bucket_view=True`, in a run whose steps show DDP's copies from the communication buckets
    back into the parameters' `.grad` (the reducer's `torch.distributed.ddp.reducer::copy_bucket_to_grad`
    ranges, one per parameter after each synchronised backward): their count and time per step (the
    copy kernels' time on a GPU profile, the ops' CPU time on a CPU one).

Why it is slow
    DDP all-reduces gradients in flat buckets. Without the flag each parameter's `.grad` is a tensor of
    its own: the backward writes it, DDP copies it into the bucket, and after the all-reduce copies the
    bucket back into `.grad`, a second full pass over every gradient per step (and a second
    gradient-sized buffer in memory). With `gradient_as_bucket_view=True` the `.grad` tensors are views
    of the buckets: the copy back disappears (the copy in becomes an in-place scaling of the bucket, the
    same traffic as before), and the gradients take no memory beyond the buckets.

Example
    model = DDP(model, device_ids=[rank])

Fix and its safety
    `opadvisor apply --rule ddp_bucket_view` adds `gradient_as_bucket_view=True` to the call (or turns
    a literal False into True). Safe: the same values in the same order. Unsafe where the script handles
    `.grad` in place itself (`p.grad.detach_()`, `p.grad.requires_grad_(...)`, `p.grad.set_(...)`,
    assigning a tensor to `p.grad`): a view cannot be detached in place (torch raises), and a replaced
    `.grad` is no view any more (DDP copies again); the codemod refuses a file that does any of these,
    with the reason. `optimizer.zero_grad()` (either set_to_none) and `p.grad = None` work with the
    views; code that keeps a `.grad` tensor across steps sees the next step's gradient in it. The saving
    shown is the measured copy time (the copies go away); the gradient memory it frees is in the notes.

    Not reported: `static_graph=True`. Its gain, the per-step search for unused parameters skipped,
    exists only with `find_unused_parameters=True`, where `ddp_find_unused` measures that search and
    drops the flag when no parameter was unused; where some were, the profile records how many at most,
    not whether the same ones every step, so it cannot tell that the graph is static.
"""

from __future__ import annotations

from opadvisor.profile.model import Construction, Op, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules.distributed._parallel import comm_of, constructions, finding_at
from opadvisor.rules.distributed.parallel_facts import DdpFacts
from opadvisor.rules.finding import Finding

ID = "ddp_bucket_view"
TITLE = "DDP copies every gradient back from its bucket"
FIX = "safe"
FIX_CAVEAT = "refused where the script detaches or replaces .grad in place"

COPY_BACK = "torch.distributed.ddp.reducer::copy_bucket_to_grad"


def detect(profile: Profile) -> list[Finding]:
    wrappers = [c for c in constructions(profile, "ddp") if not c.attrs.get("gradient_as_bucket_view")]
    copies = [op for op in profile.ops if op.name == COPY_BACK and op.step is not None]
    if not wrappers or not copies:
        return []
    return [_finding(profile, c, copies, len(wrappers)) for c in wrappers]


def _copy_ms(profile: Profile, copies: list[Op]) -> tuple[float, str]:
    """The copies' time per step (ms) and its basis: their kernels on a GPU profile, CPU time otherwise."""
    steps = max(len(profile.steps), 1)
    if profile.has_gpu:
        return sum(op.gpu_time_us or 0.0 for op in copies) / 1000.0 / steps, "copy kernels"
    return sum(op.duration_us for op in copies) / 1000.0 / steps, "CPU time of the copies"


def _finding(profile: Profile, c: Construction, copies: list[Op], wrappers: int) -> Finding:
    a = c.attrs
    time_ms, basis = _copy_ms(profile, copies)
    per_step = len(copies) / max(len(profile.steps), 1)
    grad_bytes = int(a.get("grad_bytes") or 0)
    shared = (
        [f"{wrappers} DDP wrappers without the flag: the copies cannot be told apart, each shows them all"]
        if wrappers > 1
        else []
    )
    facts = DdpFacts(
        construction_line=c.line,
        find_unused_parameters=bool(a.get("find_unused_parameters")),
        bucket_cap_mb=a.get("bucket_cap_mb"),
        gradient_as_bucket_view=False,
        static_graph=bool(a.get("static_graph")),
        grad_bytes=grad_bytes,
        bucket_copies_per_step=per_step,
        bucket_copy_ms=time_ms,
    )
    return finding_at(
        profile,
        c,
        ID,
        message=f"gradients are copied back from DDP's buckets into .grad: {per_step:g} copies/step, "
        f"{fmt_ms(time_ms)}/step ({basis}); gradient_as_bucket_view=True makes .grad a view of the bucket",
        fix="safe",
        time_ms=time_ms,
        saving_ms=time_ms,
        comm=comm_of(profile),
        notes=[
            "saving (estimate): the copies back go away; the copy into the bucket becomes an in-place "
            "scaling",
            f"memory: the gradients ({grad_bytes / 2**20:.1f} MiB) stop taking space beside the buckets",
            *shared,
        ],
        advice="build DDP with gradient_as_bucket_view=True",
        details=facts.to_details(),
    )


__all__ = ["FIX", "FIX_CAVEAT", "ID", "TITLE", "detect"]

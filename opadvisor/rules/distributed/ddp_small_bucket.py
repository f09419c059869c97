"""DistributedDataParallel with a gradient bucket far smaller than the gradients it sends.

What it finds
    A `DistributedDataParallel(model, bucket_cap_mb=...)` construction (recorded at the user's line) whose
    bucket is below SMALL_BUCKET_MB while the gradients it all-reduces are several buckets' worth: DDP then
    sends one all-reduce per bucket, many small messages per backward. The measured all-reduce time and
    calls per step (cross_rank's numbers: NCCL kernels on a GPU, gloo's ranges on a CPU) come with it.

Why it is slow
    Each all-reduce pays a fixed latency (a launch, a synchronisation of the ranks, for NCCL a few
    microseconds of protocol per ring step) whatever its size: a GPT-2-medium's 1.4 GB of float32
    gradients in 1 MB buckets are some 1,400 all-reduces a backward, each too small to reach the link's
    bandwidth. DDP's default, 25 MB, sends a few dozen and still overlaps them with the backward.

Example
    model = DDP(model, bucket_cap_mb=1)

Fix and its safety
    `opadvisor apply --rule ddp_small_bucket` writes `bucket_cap_mb=25` (DDP's default) in the call. Safe:
    the same sums, grouped in fewer messages (float rounding of the all-reduce may differ in the last bit).
    The saving shown is an estimate: the measured all-reduce time scaled by the share of messages that go
    away, times the share of communication that was exposed.
"""

from __future__ import annotations

import math

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules.distributed._parallel import comm_of, constructions, finding_at
from opadvisor.rules.distributed.parallel_facts import DdpFacts
from opadvisor.rules.finding import Finding

ID = "ddp_small_bucket"
TITLE = "DDP gradient buckets too small"
FIX = "safe"

SMALL_BUCKET_MB = 4.0  # below this a bucket is small (DDP's default is 25)
MIN_BUCKETS = 3  # report when the gradients fill at least this many small buckets
DEFAULT_BUCKET_MB = 25


def detect(profile: Profile) -> list[Finding]:
    findings = []
    for c in constructions(profile, "ddp"):
        cap = c.attrs.get("bucket_cap_mb")
        grad_bytes = int(c.attrs.get("grad_bytes") or 0)
        if not isinstance(cap, int | float) or cap <= 0 or cap >= SMALL_BUCKET_MB:
            continue
        buckets = math.ceil(grad_bytes / (cap * 2**20))
        if buckets >= MIN_BUCKETS:
            findings.append(_finding(profile, c, float(cap), grad_bytes, buckets))
    return findings


def _finding(profile: Profile, c: Construction, cap: float, grad_bytes: int, buckets: int) -> Finding:
    comm = comm_of(profile)
    after = math.ceil(grad_bytes / (DEFAULT_BUCKET_MB * 2**20))
    time_ms = comm.of("all_reduce") if comm is not None and comm.of("all_reduce") > 0 else None
    saving = time_ms * (1.0 - after / buckets) * comm.exposed_share if time_ms is not None and comm else None
    calls = comm.calls.get("all_reduce") if comm is not None else None
    measured = (
        f"all-reduce {fmt_ms(time_ms)}/step in {calls:.0f} call(s) ({comm.words()})"
        if time_ms is not None and comm is not None
        else "no all-reduce was recorded in the window"
    )
    facts = DdpFacts(
        construction_line=c.line,
        find_unused_parameters=bool(c.attrs.get("find_unused_parameters")),
        bucket_cap_mb=cap,
        grad_bytes=grad_bytes,
        buckets=buckets,
        bucket_cap_mb_fix=DEFAULT_BUCKET_MB,
    )
    return finding_at(
        profile,
        c,
        ID,
        message=f"bucket_cap_mb={cap:g}: {grad_bytes / 2**20:.1f} MiB of gradients go out in about {buckets} "
        f"all-reduces per backward where {DEFAULT_BUCKET_MB} MB buckets would send {after}; {measured}",
        fix="safe",
        time_ms=time_ms,
        saving_ms=saving,
        comm=comm,
        notes=[
            f"estimate: {DEFAULT_BUCKET_MB} MB buckets send {after} of {buckets} messages; saving = the all-reduce "
            "time x the messages that go away x the exposed share of the communication",
        ],
        advice=f"build DDP with bucket_cap_mb={DEFAULT_BUCKET_MB} (the default) or larger",
        details=facts.to_details(),
    )


__all__ = ["FIX", "ID", "TITLE", "detect"]

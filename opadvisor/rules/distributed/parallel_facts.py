"""What the profile proved about a DDP or FSDP2 wrapper (issue 34): the contract between the rules
`ddp_find_unused`, `ddp_small_bucket`, `ddp_bucket_view`, `grad_accum_sync`, `fsdp_root_only`,
`fsdp_fp32_gather`, `fsdp_reshard`, `fsdp_prefetch` and their codemods (plain data, in each finding's
`details`). The constructions they come from are described in `opadvisor/profile/model.py` (kinds "ddp"
and "fsdp")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opadvisor.rules.facts import Facts


@dataclass
class DdpFacts(Facts):
    """A `DistributedDataParallel(...)` construction. construction_line: its line. find_unused_parameters,
    bucket_cap_mb, gradient_as_bucket_view, static_graph: as built; grad_bytes: bytes of the gradients it
    reduces; unused_params: the most parameters without a gradient at an optimizer step (over
    unused_checked_steps steps); post_forward_ms: DDP's measured host time after each forward (its graph
    traversal with find_unused_parameters=True); buckets: the gradient buckets at bucket_cap_mb (estimated
    from the gradient bytes); bucket_cap_mb_fix: the size the fix writes; bucket_copies_per_step /
    bucket_copy_ms: DDP's copies of reduced gradients from the buckets back into .grad, per step, and
    their time (ms; `ddp_bucket_view`)."""

    RULES = ("ddp_small_bucket",)

    construction_line: int | None = None
    find_unused_parameters: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    grad_bytes: int = 0
    unused_params: int | None = None
    unused_checked_steps: int = 0
    post_forward_ms: float | None = None
    buckets: int | None = None
    bucket_cap_mb_fix: int = 25
    bucket_copies_per_step: float | None = None
    bucket_copy_ms: float | None = None


@dataclass
class GradSyncFacts(Facts):
    """Gradient accumulation that synchronises on every micro-step. wrapper: "ddp" or "fsdp";
    construction_line: the DDP(...) / root fully_shard(...) line; backward_per_step / synced_per_step:
    backward passes per optimizer step and how many of them all-reduced / reduce-scattered gradients
    (medians over the steps seen); forward_file / forward_line: where the wrapped model's forward was
    called; step_file / step_line: where the optimizer stepped (the accumulation loop holds both); lines:
    {"forward": [line, line], "step": [line, line]} the same lines, in the form the rewrite engine moves
    when an earlier fix of the same apply shifted them."""

    RULES = ("grad_accum_sync",)

    wrapper: str = "ddp"
    construction_line: int | None = None
    backward_per_step: float = 0.0
    synced_per_step: float = 0.0
    forward_file: str | None = None
    forward_line: int | None = None
    step_file: str | None = None
    step_line: int | None = None
    lines: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class FsdpFacts(Facts):
    """A `fully_shard(...)` call. construction_line: its line; module: the path of the module it wrapped
    ("" the model); own_params / module_params: parameters this unit owns / holds in all; units_inside: the
    units already inside it when it was called; block / count / containers / singles / param_share: the
    module's repeated blocks (as `regional_compile` records them), where a per-block `fully_shard` loop
    goes; autocast: the autocast dtype of the forward (None without autocast); param_dtypes: the dtypes of
    its parameters; mp_param_dtype: its MixedPrecisionPolicy's param_dtype (None: none given); given: the
    keywords passed to the call (each block's call gets the same ones); units: the collectives of every unit
    (`rules/_units.py`: unit, collective, calls_per_step, mib_per_call, dtype, ms_per_step and
    exposed_ms_per_step on a GPU profile), most exposed first."""

    RULES = ("fsdp_fp32_gather", "fsdp_root_only")

    construction_line: int | None = None
    module: str | None = None
    own_params: int = 0
    module_params: int = 0
    units_inside: int = 0
    block: str = ""
    count: int = 0
    containers: list[str] = field(default_factory=list)
    singles: list[str] = field(default_factory=list)
    param_share: float | None = None
    autocast: str | None = None
    param_dtypes: list[str] = field(default_factory=list)
    mp_param_dtype: str | None = None
    given: list[str] = field(default_factory=list)
    units: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ReshardFacts(Facts):
    """`fully_shard(...)` calls whose units gathered their parameters again in backward (`fsdp_reshard`).
    construction_line: the call's line; modules: the units' module paths; root: one of them is the root
    unit; backward_gathers_per_step: their all-gathers in backward; backward_gather_ms /
    backward_gather_exposed_ms: the NCCL time of those and its exposed part (None on a CPU profile);
    peak_allocated_bytes, gpu_memory_bytes: the measured peak and the GPU's memory; kept_bytes: the
    unsharded parameters the fix keeps from forward to backward; memory_fraction: the rule's limit."""

    construction_line: int | None = None
    modules: list[str] = field(default_factory=list)
    root: bool = False
    backward_gathers_per_step: float = 0.0
    backward_gather_ms: float | None = None
    backward_gather_exposed_ms: float | None = None
    peak_allocated_bytes: int = 0
    gpu_memory_bytes: int = 0
    kept_bytes: int = 0
    memory_fraction: float = 0.85


@dataclass
class PrefetchFacts(Facts):
    """Per-block units whose forward all-gather started after the previous unit's compute
    (`fsdp_prefetch`). construction_line: the call's line; late_units: those units; late_gathers /
    handovers: the late gathers and the unit-to-unit hand-overs of the recorded forwards; median_gap_us:
    how long after the previous unit's last compute kernel the gathers started; exposed_ms: their time no
    compute overlapped, per step."""

    construction_line: int | None = None
    late_units: list[str] = field(default_factory=list)
    late_gathers: int = 0
    handovers: int = 0
    median_gap_us: float = 0.0
    exposed_ms: float = 0.0


__all__ = ["DdpFacts", "FsdpFacts", "GradSyncFacts", "PrefetchFacts", "ReshardFacts"]

"""Float32 matrix products on a GPU with tensor cores, running without TF32.

What it finds
    In a CUDA profile from a GPU of compute capability 8.0 or newer (A100, H100, H200, L40, RTX 30/40...,
    judged by the device the profile ran on): the matrix products (`mm`, `addmm`, `bmm`, `baddbmm`, the
    GEMMs under `nn.Linear`, `@` and `matmul`, forward and backward) whose inputs are float32 and whose
    kernels are not tensor-core kernels. A GEMM already running on TF32 (cuBLAS kernels named `...tf32...`,
    CUTLASS `tensorop_s1688gemm`) or in bf16/fp16 under autocast is not reported. One finding per profile,
    because one setting fixes them all: its time is the sum over all sites, and the sites, heaviest first,
    are in the finding's details. Reported when TF32 would save at least 1% of the step (tiny float32
    GEMMs are bound by latency and would not get faster).

Why it is slow
    PyTorch runs float32 matrix products in full IEEE float32 by default
    (`torch.backends.cuda.matmul.allow_tf32 = False`), on the CUDA cores. Tensor cores do TF32 (float32
    range, 10-bit mantissa) about 7x faster: on an H200 a 4096^3 float32 GEMM took 2.68 ms (51 TFLOP/s)
    and 0.35 ms (392 TFLOP/s) with TF32; bf16 ran 13x faster than float32. Small GEMMs gain less (they are
    bound by latency, not arithmetic), which the saving estimate takes into account.

Example
    model = MyModel().cuda()               # float32 parameters, no autocast
    loss = model(x).loss                   # every nn.Linear runs a float32 sgemm

Fix and its safety
    `torch.backends.cuda.matmul.allow_tf32 = True` (or `torch.set_float32_matmul_precision("high")`) once
    at the top of the script, which the finding points at; or bf16 autocast around the forward pass
    (`with torch.autocast("cuda", dtype=torch.bfloat16):`). Both change numerics (TF32 rounds the
    inputs of each product to 10 mantissa bits; autocast computes in bf16): unsafe. Most training is
    insensitive to it, which `opadvisor verify` checks on the script's own losses. Never reported on a
    CPU profile.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._chains import in_dtype, matmul_mnk
from opadvisor.rules._findings import fmt_ms, fmt_share, module_pattern
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import source_status
from opadvisor.rules.engine import NeedsGpuProfile, NotApplicable
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "fp32_gemm"
TITLE = "float32 matrix products without TF32"
FIX = "unsafe"

MIN_CAPABILITY = (8, 0)
GEMM_LEAF_OPS = frozenset(
    "aten::" + n for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "matmul", "linear")
)
# Kernel-name fragments of tensor-core GEMMs (TF32, or bf16/fp16 under a lower matmul precision).
TENSOR_CORE_MARKS = ("tf32", "tensorop", "1688", "16816", "hmma", "bf16", "f16", "gmma", "warpgroup", "nvjet")
# Estimated speed-up of a compute-bound float32 GEMM under TF32 (measured 6.6x-7.6x on an H200; kept low).
TF32_SPEEDUP = 4.0
# Report when TF32 would save at least this share of the step and this many ms per step (tiny GEMMs,
# bound by latency, would not get faster).
MIN_SAVING_SHARE = 0.01
MIN_SAVING_MS = 0.02
# Float32 FMA throughput per SM per clock, by major capability (Ampere A100: 64 FP32 lanes; later: 128).
_FP32_FLOP_PER_SM_CLK = {8: 128, 9: 256, 10: 256, 12: 256}
_ASSUMED_CLOCK_HZ = 1.6e9


@dataclass
class Fp32GemmFacts(Facts):
    """What an fp32_gemm finding carries: the line after which the setting goes and whether the script
    imports torch, the setting and its alternative, the GPU and its compute capability, and the float32
    matrix-product sites (per line: time, saving, count, modules, ...)."""

    RULES = ("fp32_gemm",)
    insert_after_line: int = 0
    imports_torch: bool = False
    setting: str = "torch.backends.cuda.matmul.allow_tf32 = True"
    alternative: str = 'torch.set_float32_matmul_precision("high")'  # a setting, not the engine's alternative
    capability: list[int] = field(default_factory=list)
    gpu: str | None = None
    sites: list[dict[str, Any]] = field(default_factory=list)


def _fp32_peak_flops(profile: Profile) -> float:
    env = profile.environment
    cap = env.capability or [8, 0]
    per_sm = _FP32_FLOP_PER_SM_CLK.get(cap[0], 256)
    if cap[0] == 8 and cap[1] != 0:  # GA10x / AD10x: 128 FP32 lanes per SM
        per_sm = 256
    return (env.sm_count or 100) * per_sm * _ASSUMED_CLOCK_HZ


def _is_tensor_core(kernel_name: str) -> bool:
    k = kernel_name.lower()
    return any(mark in k for mark in TENSOR_CORE_MARKS)


def _flops(op: Op) -> float | None:
    mnk = matmul_mnk(op)
    if mnk is None:
        return None
    batch, m, n, k = mnk
    return 2.0 * batch * m * n * k


def _fp32_gemms(profile: Profile) -> list[Op]:
    """GEMM ops that launched kernels themselves, with float32 inputs and no tensor-core kernel."""
    out = []
    for op in profile.ops:
        if op.step is None or not op.kernels or op.name not in GEMM_LEAF_OPS:
            continue
        if in_dtype(op) != "float32":
            continue
        if any(_is_tensor_core(k.name) for k in op.kernels):
            continue
        out.append(op)
    return out


def _fix_line(script: str) -> tuple[int, int, bool]:
    """(line, end_line, imports torch) of the statement after which the setting goes: the first top-level
    import of torch in the script, else its last top-level import, else line 1."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return 1, 1, False
    last = None
    for node in tree.body:
        if isinstance(node, ast.Import):
            if any(a.name == "torch" and a.asname is None for a in node.names):
                return node.lineno, node.end_lineno or node.lineno, True
            last = node
        elif isinstance(node, ast.ImportFrom):
            last = node
    if last is not None:
        return last.lineno, last.end_lineno or last.lineno, False
    return 1, 1, False


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile("TF32 applies to GPU matrix products only")
    cap = tuple(profile.environment.capability or ())
    if len(cap) < 2:
        raise NotApplicable("the profile does not record the GPU's compute capability")
    if cap < MIN_CAPABILITY:
        return []  # no TF32 tensor cores before Ampere
    ix = index_of(profile)
    gemms = _fp32_gemms(profile)
    if not gemms:
        return []
    sites, total_us, saving_us = _sites(profile, gemms)
    ms = ix.per_step_ms(total_us)
    saving_ms = ix.per_step_ms(saving_us)
    share = ix.share_of_step(ms)
    saving_share = ix.share_of_step(saving_ms)
    if saving_ms < MIN_SAVING_MS or saving_share is None or saving_share < MIN_SAVING_SHARE:
        return []
    site_list = _site_list(ix, sites)
    script = profile.script
    line, end, has_torch = _fix_line(script)
    if source_status(profile, script) == "missing":
        line = end = 1
    gpu = profile.environment.gpu_name or "this GPU"
    top = site_list[0]
    where = f"{Path(top['path']).name}:{top['line']}" if top["path"] else "an unknown line"
    message = (
        f"{len(gemms) / ix.steps_recorded:.0f} float32 matrix products per step run without TF32 on {gpu} "
        f"(sm_{cap[0]}{cap[1]}): {fmt_ms(ms)}/step ({fmt_share(share)} of the step); the heaviest at {where}"
    )
    return [
        Finding(
            rule=ID,
            path=script,
            line=line,
            end_line=end,
            message=message,
            fix="unsafe",
            function=None,
            module=module_pattern(op.module for op in gemms),
            evidence=_evidence(ix, gemms, ms, share),
            time_ms_per_step=ms,
            est_saving_ms_per_step=saving_ms,
            advice=(
                'torch.backends.cuda.matmul.allow_tf32 = True (or torch.set_float32_matmul_precision("high")) '
                "at the top of the script, or bf16 autocast around the forward pass; both change numerics "
                "(unsafe): check the losses with opadvisor verify"
            ),
            details=Fp32GemmFacts(
                insert_after_line=end,
                imports_torch=has_torch,
                capability=list(cap),
                gpu=profile.environment.gpu_name,
                sites=site_list,
            ).to_details(),
        )
    ]


def _sites(profile: Profile, gemms: list[Op]) -> tuple[dict, float, float]:
    """(per source line: kernel time, TF32 saving, count, modules, backward time, flops; the total time;
    the total saving), all in us over the recorded steps."""
    peak = _fp32_peak_flops(profile)
    sites: dict[tuple[str | None, int | None], dict] = defaultdict(
        lambda: {"us": 0.0, "saving_us": 0.0, "count": 0, "modules": set(), "backward_us": 0.0, "flops": 0.0}
    )
    total_us = saving_us = 0.0
    for op in gemms:
        us = sum(k.duration_us for k in op.kernels)
        flops = _flops(op)
        if flops and us > 0:
            # compute-bound share: how close the GEMM ran to the GPU's float32 peak (small GEMMs gain little)
            bound = min(1.0, flops / (us * 1e-6) / (0.8 * peak))
            gain = us * (1 - 1 / TF32_SPEEDUP) * bound * bound
        else:
            gain = 0.0
        site = sites[(op.file, op.line)]
        site["us"] += us
        site["saving_us"] += gain
        site["count"] += 1
        site["flops"] += flops or 0.0
        if op.is_backward:
            site["backward_us"] += us
        site["modules"].add(op.module)
        total_us += us
        saving_us += gain

    return sites, total_us, saving_us


def _site_list(ix: ProfileIndex, sites: dict) -> list[dict]:
    """The sites, heaviest first, per step."""
    ranked = sorted(sites.items(), key=lambda kv: -kv[1]["us"])
    return [
        {
            "path": path,
            "line": line,
            "module": module_pattern(s["modules"]),
            "gemms_per_step": s["count"] / ix.steps_recorded,
            "ms_per_step": ix.per_step_ms(s["us"]),
            "backward_ms_per_step": ix.per_step_ms(s["backward_us"]),
            "tflops": (s["flops"] / (s["us"] * 1e-6) / 1e12) if s["us"] else None,
        }
        for (path, line), s in ranked
    ]


def _evidence(ix: ProfileIndex, gemms: list[Op], ms: float | None, share: float | None) -> Evidence:
    kernels = sorted({k.name for op in gemms for k in op.kernels})
    return Evidence(
        ops=sorted({op.name for op in gemms}),
        kernel_count=round(sum(len(op.kernels) for op in gemms) / ix.steps_recorded),
        shapes=[s for s in (op.input_shapes[0] for op in gemms[:8]) if isinstance(s, list)],
        dtypes=["float32"],
        time_ms_per_step=ms,
        share_of_step=share,
        time_basis="gpu",
        occurrences=max(1, round(len(gemms) / ix.steps_recorded)),
        notes=[f"float32 GEMM kernels: {', '.join(k[:60] for k in kernels[:3])}"],
    )


__all__ = ["FIX", "ID", "TITLE", "detect"]

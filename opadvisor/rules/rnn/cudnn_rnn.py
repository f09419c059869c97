"""nn.LSTM / nn.GRU / nn.RNN calls that miss cuDNN's fast path on the GPU.

What it finds
    In a CUDA profile, a recurrent layer whose calls (the profile records each module call and checks its
    weights the way cuDNN does):
    - pass weights that are not one contiguous buffer: every call then copies them into one (and warns
      "RNN module weights are not part of single contiguous chunk of memory"), in backward as well. It
      happens after a weight's data is replaced in place (`lstm.weight_hh_l0.data = ...`, an
      initialisation or a weight drop written that way: nn.LSTM re-packs a replaced Parameter by itself,
      not replaced data) and in `nn.DataParallel` replicas;
    - do not run cuDNN at all (no `_cudnn_rnn` op under the call: `torch.backends.cudnn.enabled = False`,
      or inputs cuDNN does not take): PyTorch's own recurrence launches kernels for every time step;
    - run in float32 without autocast on a GPU with tensor cores (compute capability 7.0 or newer): cuDNN
      runs TF32 at best (if `torch.backends.cudnn.allow_tf32`, the default), bf16/fp16 about twice as fast.
    The finding points at the line calling the layer, with the time of its forward and backward.

Why it is slow
    cuDNN's recurrent kernels read the weights from one packed buffer; when the module's weights are
    separate tensors each call packs them first (a copy of all weights, and of their gradients back) and
    holds the packed copy as well. Without cuDNN a 1000-step sequence is 1000 launches of the cell's
    kernels, forward and backward. In float32 the recurrence does its matrix products at TF32 or FP32
    speed on tensor-core hardware built for 16-bit inputs.

Example
    self.lstm.weight_hh_l0.data = new_weight   # the packed buffer is left behind from then on
    out, (h, c) = self.lstm(x)

Fix and its safety
    Weights not contiguous: `opadvisor apply --rule cudnn_rnn` inserts `self.lstm.flatten_parameters()`
    before the call. It re-packs the weights into one buffer in place (the parameters stay the same
    objects, so the optimizer keeps them) and does nothing when they are already packed: safe, the same
    values. cuDNN off, or float32: display only. Turning cuDNN on changes the kernels (and determinism, if
    that is why it was off); bf16 autocast around the forward (`with torch.autocast("cuda",
    dtype=torch.bfloat16):`, as `fp32_gemm` advises for the whole step) changes numerics: decide with
    `opadvisor verify`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opadvisor.profile.model import ModuleCall, Op, Profile
from opadvisor.rules._findings import cost_words, fmt_ms
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "cudnn_rnn"
TITLE = "Recurrent layer off cuDNN's fast path"
FIX = "safe"
FIX_CAVEAT = "none where cuDNN is off or the layer runs in float32 (advice only)"

LAYERS = ("LSTM", "GRU", "RNN")
TENSOR_CORES = (7, 0)
BF16 = (8, 0)
COPY_OPS = frozenset({"aten::copy_", "aten::zero_", "aten::fill_", "aten::cat", "aten::_copy_from"})


@dataclass
class CudnnRnnFacts(Facts):
    """What the profile saw of the layer's calls (the finding's `details`; the codemod inserts
    flatten_parameters() only where `problems` holds "not_flat", before a call of `module`'s last part)."""

    RULES = ("cudnn_rnn",)

    kind: str = ""  # "LSTM", "GRU" or "RNN"
    module: str = ""
    problems: list[str] = field(default_factory=list)  # "not_flat", "no_cudnn", "float32"
    call_line: int | None = None
    calls_not_flat: int = 0  # calls in the window whose weights were not one packed buffer
    calls: int = 0
    weight_dtype: str | None = None
    autocast: str | None = None


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile("cuDNN's fused recurrent kernels exist only on the GPU")
    ix = index_of(profile)
    findings = []
    for call in profile.module_calls:
        attrs = call.attrs
        if attrs.get("kind") not in LAYERS or attrs.get("device") != "cuda" or not call.file or not call.line:
            continue
        ops = ix.module_ops(call.module, call.module_class)
        if not ops:
            continue
        problems = _problems(profile, ix, call, ops)
        if problems:
            findings.append(_finding(profile, ix, call, ops, problems))
    return findings


def _problems(profile: Profile, ix: ProfileIndex, call: ModuleCall, ops: list[Op]) -> list[str]:
    attrs = call.attrs
    found = []
    cudnn = any(d.name == "aten::_cudnn_rnn" for op in ops for d in (op, *ix.descendants(op)))
    if not cudnn:
        found.append("no_cudnn")
    elif attrs.get("calls_not_flat"):
        found.append("not_flat")
    cap = tuple(profile.environment.capability or (0, 0))
    if attrs.get("weight_dtype") == "float32" and not attrs.get("autocast") and cap >= TENSOR_CORES:
        found.append("float32")
    return found


def _copy_us(ix: ProfileIndex, ops: list[Op]) -> float:
    """GPU time of the weight packing: copies under the layer's ops and the backward ops linked to them."""
    total = 0.0
    for op in ops:
        for root in (op, *ix.backward_ops(op)):
            total += sum(ix.cost_us(d) for d in ix.descendants(root) if d.name in COPY_OPS)
    return total


def _finding(
    profile: Profile, ix: ProfileIndex, call: ModuleCall, ops: list[Op], problems: list[str]
) -> Finding:
    attrs = call.attrs
    kind = attrs["kind"]
    ms = ix.per_step_ms(ix.site_cost_us(ops))
    share = ix.share_of_step(ms)
    name = call.module or "(model)"
    said, notes, fix, saving, advice = _what_is_wrong(profile, ix, call, ops, problems)
    src = load_profiled_source(profile, call.file or "")
    first, last = src.statement_span(call.line) if src is not None else (call.line, call.line)
    message = (
        f"nn.{kind} {name}: "
        + "; ".join(said)
        + f". Its forward and backward take {cost_words(ix, ms, share)}"
    )
    return Finding(
        rule=ID,
        path=call.file or "",
        line=first,
        end_line=last,
        message=message,
        fix=fix,  # type: ignore[arg-type]
        function=call.function,
        module=call.module,
        evidence=Evidence(
            ops=sorted({op.name for op in ops}),
            kernel_count=round(ix.site_kernels(ops) / ix.steps_recorded),
            shapes=[attrs["input_shape"]] if attrs.get("input_shape") else [],
            dtypes=[d for d in (attrs.get("input_dtype"), attrs.get("weight_dtype")) if d],
            time_ms_per_step=ms,
            share_of_step=share,
            time_basis="gpu",
            occurrences=max(1, round(call.calls / ix.steps_recorded)),
            notes=notes,
        ),
        time_ms_per_step=ms,
        est_saving_ms_per_step=saving,
        advice=advice,
        details=CudnnRnnFacts(
            kind=kind,
            module=call.module,
            problems=problems,
            call_line=call.line,
            calls_not_flat=attrs.get("calls_not_flat", 0),
            calls=call.calls,
            weight_dtype=attrs.get("weight_dtype"),
            autocast=attrs.get("autocast"),
        ).to_details(),
    )


def _what_is_wrong(
    profile: Profile, ix: ProfileIndex, call: ModuleCall, ops: list[Op], problems: list[str]
) -> tuple[list[str], list[str], str, float | None, str]:
    """(what is said of each problem, notes, fix safety, saving, advice) for the call's problems."""
    attrs = call.attrs
    said, notes = [], []
    fix, saving, advice = "none", None, ""
    if "not_flat" in problems:
        copy_ms = ix.per_step_ms(_copy_us(ix, ops))
        said.append(
            f"its weights are not one contiguous buffer in {attrs['calls_not_flat']} of {call.calls} calls, so "
            f"cuDNN packs them at every call ({fmt_ms(copy_ms)}/step of copies)"
        )
        fix, saving = "safe", copy_ms
        advice = f"call {_callee(call)}.flatten_parameters() before the call (re-packs the weights in place)"
    if "no_cudnn" in problems:
        why = (
            "torch.backends.cudnn.enabled is False"
            if not attrs.get("cudnn_enabled", True)
            else "cuDNN refused it"
        )
        said.append(f"it does not run cuDNN ({why}): PyTorch's own recurrence launches kernels per time step")
        advice = advice or "let cuDNN run it (torch.backends.cudnn.enabled = True; check the input dtype)"
    if "float32" in problems:
        cap = tuple(profile.environment.capability or (0, 0))
        dtype = "bfloat16" if cap >= BF16 else "float16"
        tf32 = "TF32" if attrs.get("cudnn_tf32") else "full float32 (cudnn.allow_tf32 is off)"
        said.append(f"it runs in float32 ({tf32} at best) on a GPU with 16-bit tensor cores")
        autocast = f'with torch.autocast("cuda", dtype=torch.{dtype}): around the forward'
        notes.append(f"float32: {autocast} runs cuDNN's 16-bit kernels (changes numerics: check with verify)")
        advice = advice or autocast
    return said, notes, fix, saving, advice


def _callee(call: ModuleCall) -> str:
    """How the call site names the layer, as far as the profile knows: `self.<last part>`."""
    return "self." + call.module.rpartition(".")[2] if call.module else "model"


__all__ = ["FIX", "FIX_CAVEAT", "ID", "TITLE", "CudnnRnnFacts", "detect"]

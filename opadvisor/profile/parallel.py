"""Data-parallel wrappers the script builds, recorded at the user's line: DDP and FSDP2 (issue 34).

The session (`session.py`) drives one `ParallelRecorder` for the script's lifetime:

- `DistributedDataParallel(...)`: a construction of kind "ddp" with its settings (find_unused_parameters,
  bucket_cap_mb, gradient_as_bucket_view, static_graph), the gradient bytes it reduces, and, after the run,
  how many parameters never received a gradient (`unused_params`: a parameter that requires grad whose
  `.grad` is still None at an optimizer step) and the host time of DDP's `_post_forward` per forward (with
  `find_unused_parameters=True` it traverses the autograd graph there: `post_forward_ms`).
- `fully_shard(module, ...)` (torch.distributed.fsdp, also reached as torch.distributed._composable.fsdp):
  a construction of kind "fsdp" per call, its `module` the path of the module it was applied to (filled
  in when the model is first called), with the parameters that unit owns (those not already in a unit
  inside it), its reshard_after_forward and MixedPrecisionPolicy dtypes, how many units were inside it,
  and, for a call on a module with no unit inside, that module's repeated blocks (`blocks.repeated_blocks`:
  where a per-block `fully_shard` loop would go).
- Gradient accumulation, on the construction of the module whose forward the script calls (the DDP
  wrapper, or the outermost FSDP unit): between two optimizer steps, how many backward passes ran and how
  many of them synchronised gradients (`grad_sync`). DDP decides at each forward (`require_backward_grad_sync`,
  which `no_sync()` clears), so forwards with grad enabled are counted; FSDP2 decides in backward
  (`set_requires_gradient_sync`), so its root's end-of-backward callback counts, reading the units' flag.
  Also recorded there: the autocast dtype the forward ran under (`autocast`), and where the forward and the
  optimizer step were called (`forward_at`, `step_at`: [file, line]), which the accumulation fix reads.

Recording never changes what the script computes; a failure to record becomes a session warning.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from opadvisor.profile.blocks import repeated_blocks
from opadvisor.profile.model import Construction
from opadvisor.profile.userframes import innermost_user_frame

MAX_STEPS_KEPT = 64  # per-step accumulation counts kept in profile.json (the first ones)
MAX_TIMED_CALLS = 256  # DDP _post_forward calls timed

AddConstruction = Callable[[str, Any, str, dict[str, Any]], Construction]


class ParallelRecorder:
    """DDP / FSDP2 constructions and gradient-accumulation counts (see the module doc)."""

    def __init__(self, add_construction: AddConstruction, warnings: list[str]) -> None:
        self._add = add_construction
        self._warnings = warnings
        self._by_module: dict[
            int, tuple[Any, Construction]
        ] = {}  # id(module) -> (weak-ish ref, construction)
        self._pending: dict[
            int, list[int]
        ] = {}  # id(root module) -> [backward passes, synced] since the step
        self._timings: dict[int, list[float]] = {}  # id(ddp) -> _post_forward seconds per call
        self._undo: list[Callable[[], None]] = []

    # ---- install / uninstall -----------------------------------------------------------------------------
    def install(self) -> Callable[[], None]:
        """Wrap fully_shard, FSDP2's end-of-backward callback and DDP's _post_forward; return the undo."""
        try:
            self._wrap_fully_shard()
            self._wrap_fsdp_backward()
            self._wrap_ddp_post_forward()
        except (ImportError, AttributeError) as exc:  # a torch without these: nothing to record
            self._warnings.append(f"data-parallel wrappers are not recorded: {exc}")
        return self._uninstall

    def _uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))

    def _wrap_fully_shard(self) -> None:
        import torch.distributed.fsdp as fsdp

        original = fsdp.fully_shard

        @functools.wraps(original)
        def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            before = self._guarded(lambda: _before_shard(module), None)
            out = original(module, *args, **kwargs)
            if before is not None:
                self._guarded(lambda: self._record_fsdp(module, kwargs, before), None)
            return out

        # every module that exports the function (torch.distributed.fsdp, ._composable.fsdp, ...)
        for name, mod in list(sys.modules.items()):
            if name.startswith("torch.distributed") and getattr(mod, "fully_shard", None) is original:
                self._patch(mod, "fully_shard", fully_shard)

    def _wrap_fsdp_backward(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        original = FSDPState._root_post_backward_final_callback

        @functools.wraps(original)
        def callback(state: Any) -> Any:
            self._guarded(lambda: self._count_fsdp_backward(state), None)
            return original(state)

        self._patch(FSDPState, "_root_post_backward_final_callback", callback)

    def _wrap_ddp_post_forward(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        original = DistributedDataParallel._post_forward

        @functools.wraps(original)
        def post_forward(ddp: Any, output: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(ddp, output)
            finally:
                times = self._timings.get(id(ddp))
                if times is not None and len(times) < MAX_TIMED_CALLS:
                    times.append(time.perf_counter() - start)

        self._patch(DistributedDataParallel, "_post_forward", post_forward)

    def _guarded(self, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # recording must never break the user's script
            self._warnings.append(f"could not record a data-parallel wrapper: {exc}")
            return default

    # ---- constructions -------------------------------------------------------------------------------
    def record_ddp(self, ddp: Any, args: tuple, kwargs: dict) -> None:
        """`DistributedDataParallel.__init__` just ran (the session's constructor wrapper calls this)."""
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        attrs: dict[str, Any] = {
            "find_unused_parameters": bool(ddp.find_unused_parameters),
            "bucket_cap_mb": round(ddp.bucket_bytes_cap / 2**20, 4),
            "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
            "static_graph": bool(ddp.static_graph),
            "given": sorted(k for k in kwargs if k != "module"),
            "param_tensors": len(params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            **_group_facts(getattr(ddp, "process_group", None)),
        }
        construction = self._add("ddp", ddp, "torch.nn.parallel", attrs)
        self._by_module[id(ddp)] = (ddp, construction)
        self._timings[id(ddp)] = []

    def _record_fsdp(self, module: Any, kwargs: dict[str, Any], before: dict[str, Any]) -> None:
        modules = module if isinstance(module, list | tuple) else [module]
        inner: set[int] = before.pop("inner_params")
        own = [p for m in modules for p in m.parameters() if id(p) not in inner]
        policy = kwargs.get("mp_policy")
        attrs: dict[str, Any] = {
            "own_params": sum(p.numel() for p in own),
            "own_param_bytes": sum(p.numel() * p.element_size() for p in own),
            "own_param_tensors": len(own),
            "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in own}),
            "reshard_after_forward": _shown(kwargs.get("reshard_after_forward")),
            "mp_param_dtype": _dtype_name(getattr(policy, "param_dtype", None)),
            "mp_reduce_dtype": _dtype_name(getattr(policy, "reduce_dtype", None)),
            "given": sorted(kwargs),
            "grouped": len(modules) if len(modules) > 1 else None,
            **before,
            **_group_facts(None),
        }
        construction = self._add("fsdp", modules[0], "torch.nn", attrs)
        construction.cls = "torch.distributed.fsdp.fully_shard"
        self._by_module[id(modules[0])] = (modules[0], construction)

    # ---- at run time ---------------------------------------------------------------------------------
    def watches(self, key: int) -> bool:
        """Whether the module with this id is a DDP wrapper or an FSDP unit (the session's pre hook asks)."""
        return key in self._by_module

    def on_wrapper_forward(self, module: Any) -> None:
        """A wrapper's forward begins: DDP's sync decision, the autocast dtype, the forward's line."""
        self._guarded(lambda: self._wrapper_forward(module), None)

    def _wrapper_forward(self, module: Any) -> None:
        import torch

        entry = self._by_module.get(id(module))
        if entry is None or not torch.is_grad_enabled():
            return
        construction = entry[1]
        attrs = construction.attrs
        if "forward_at" not in attrs:
            frame = innermost_user_frame()
            attrs["forward_at"] = [frame[0], frame[1]] if frame else None
            attrs["autocast"] = _autocast_dtype()
        if construction.kind == "ddp":
            counts = self._pending.setdefault(id(module), [0, 0])
            counts[0] += 1
            counts[1] += bool(module.require_backward_grad_sync)

    def _count_fsdp_backward(self, state: Any) -> None:
        modules = getattr(state, "_modules", ()) or ()
        root = next((m for m in modules if id(m) in self._by_module), None)
        if root is None:
            return
        groups = [g for s in state._state_ctx.all_states for g in _param_groups(s)]
        counts = self._pending.setdefault(id(root), [0, 0])
        counts[0] += 1
        counts[1] += any(g.reduce_grads for g in groups)

    def on_optimizer_step(self) -> None:
        """An optimizer step: close each wrapper's accumulation window; DDP's parameters without a grad."""
        if self._by_module:
            self._guarded(self._close_step, None)

    def _close_step(self) -> None:
        for key, (module, construction) in self._by_module.items():
            counts = self._pending.pop(key, None)
            attrs = construction.attrs
            if counts is not None:
                sync = attrs.setdefault("grad_sync", {"steps": 0, "backward": 0, "synced": 0, "per_step": []})
                sync["steps"] += 1
                sync["backward"] += counts[0]
                sync["synced"] += counts[1]
                if len(sync["per_step"]) < MAX_STEPS_KEPT:
                    sync["per_step"].append(counts)
                if "step_at" not in attrs:
                    frame = innermost_user_frame()
                    attrs["step_at"] = [frame[0], frame[1]] if frame else None
            if construction.kind == "ddp":
                unused = sum(1 for p in module.module.parameters() if p.requires_grad and p.grad is None)
                attrs["unused_params"] = max(attrs.get("unused_params", 0), unused)
                attrs["unused_checked_steps"] = attrs.get("unused_checked_steps", 0) + 1

    def finish(self, module_paths: dict[int, str], outer: int | None) -> None:
        """After the script: module paths, which unit is the root, DDP's measured _post_forward time."""
        for key, (module, construction) in self._by_module.items():
            if construction.kind == "fsdp":
                construction.module = module_paths.get(key)
                root = self._guarded(lambda m=module: _is_root(m), None)
                construction.attrs["root"] = root if root is not None else key == outer
            times = self._timings.get(key)
            if times and len(times) > 1:
                # the first call pays for DDP's lazy set-up: left out
                construction.attrs["post_forward_ms"] = round(statistics.median(times[1:]) * 1000.0, 4)


# ---- facts -------------------------------------------------------------------------------------------


def _before_shard(module: Any) -> dict[str, Any]:
    """What fully_shard is about to wrap: units already inside it, their parameters, its repeated blocks."""
    from torch.distributed.fsdp import FSDPModule

    modules = module if isinstance(module, list | tuple) else [module]
    inner = [s for m in modules for s in m.modules() if s is not m and isinstance(s, FSDPModule)]
    inner_params = {id(p) for s in inner for p in s.parameters()}
    facts: dict[str, Any] = {
        "inner_params": inner_params,
        "units_inside": len(inner),
        "module_params": sum(p.numel() for m in modules for p in m.parameters()),
    }
    if not inner and len(modules) == 1:
        blocks = repeated_blocks(modules[0])
        if blocks is not None:
            facts["blocks"] = blocks
    return facts


def _is_root(module: Any) -> bool | None:
    """FSDP2's own word on whether the unit is the root (set at its first forward); None when unknown."""
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    root = getattr(state, "_is_root", None)
    return root if isinstance(root, bool) else None


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list in recent torch (2.13), one group (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _group_facts(group: Any) -> dict[str, Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"world_size": None, "backend": None}
    return {"world_size": dist.get_world_size(group), "backend": str(dist.get_backend(group))}


def _autocast_dtype() -> str | None:
    import torch

    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return _dtype_name(torch.get_autocast_dtype(device))
    return None


def _dtype_name(dtype: Any) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _shown(value: Any) -> Any:
    return value if value is None or isinstance(value, bool | int) else repr(value)


__all__ = ["ParallelRecorder"]

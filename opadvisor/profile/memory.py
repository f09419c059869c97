"""Memory the profile records per step: CUDA peaks, and what each module saves for backward.

- **Peak memory (CUDA).** The caching allocator's peak counters are reset when a step starts
  (`torch.cuda.reset_peak_memory_stats`) and read when it ends: `max_memory_allocated` (bytes in live
  tensors) and `max_memory_reserved` (bytes the allocator holds from the device: what an out-of-memory
  error runs out of). The allocator counts on the host as ops are dispatched, so no synchronisation is
  needed. A script that reads these counters itself sees them reset at each recorded step.
- **Activation memory (any device).** While a step runs, `torch.autograd.graph.saved_tensors_hooks`
  sees every tensor autograd saves for backward. Each storage is counted once per step, under the
  innermost module running when it was first saved (the session keeps the module stack); storages of
  parameters and buffers are not activations and are left out (a cast copy of a weight under autocast is
  counted: the graph holds it until backward). Tensors saved while a backward runs (a reentrant
  checkpoint's recomputation) are transient and left out; tensors saved inside a user's own
  saved-tensor hooks (`torch.utils.checkpoint`, `save_on_cpu`) go to those hooks, not ours, which is what
  they hold: nothing on the device.

The pack hook returns a detached alias and the version the tensor had, and the unpack hook raises
autograd's own error when the tensor was modified in place since (saved-tensor hooks otherwise turn that
check off); the alias holds no reference to its graph node, so a graph dropped without backward is freed at
once, as it would be without the hooks. When the user's code already has saved-tensor hooks active at a
step's start (a `save_on_cpu()` around the whole loop), ours would replace theirs: that step's activation
memory is not measured, and the profile says so.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from opadvisor.profile.model import ModuleCall, Profile, Step

OUTSIDE = None  # the key of tensors saved outside every module (a loss computed in the training loop)


@dataclass
class StepMemory:
    """What one step measured; None where it could not be measured."""

    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    allocated_at_start_bytes: int | None = None
    saved_bytes: int | None = None  # distinct storages saved for backward during the step
    # (module path, class) -> [bytes, storages] first saved while it was the innermost module running
    by_module: dict[tuple[str, str] | None, list[int]] = field(default_factory=dict)


class MemoryRecorder:
    """Per-step CUDA peaks and activation memory by module (see the module docstring)."""

    def __init__(self, cuda: bool, activations: bool = True) -> None:
        self.cuda = cuda
        self.activations = activations
        self.notes: list[str] = []
        self._local = threading.local()  # the module stack, per thread (DataParallel threads have their own)
        self._hooks: Any = None
        self._active = False
        self._persistent: set[int] = set()
        self._seen: set[int] = set()
        self._current: StepMemory | None = None
        self._roots: list[Any] = []

    # ---- the module stack (driven by the session's global forward hooks) ----------------------------
    def add_root(self, module: Any) -> None:
        """A model (the outermost module of a call tree): its parameters and buffers are not activations."""
        self._roots.append(weakref.ref(module))  # weak: a model the script drops is freed as usual

    def enter(self, key: tuple[str, str]) -> None:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(key)

    def exit(self) -> None:
        stack = getattr(self._local, "stack", None)
        if stack:
            stack.pop()

    def _innermost(self) -> tuple[str, str] | None:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else OUTSIDE

    # ---- steps ----------------------------------------------------------------------------------------
    def start_step(self) -> None:
        import torch

        self._current = StepMemory()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._current.allocated_at_start_bytes = torch.cuda.memory_allocated()
        if self.activations:
            self._start_activations()

    def end_step(self) -> StepMemory:
        import torch

        step = self._current if self._current is not None else StepMemory()
        self._current = None
        if self.cuda:
            step.peak_allocated_bytes = torch.cuda.max_memory_allocated()
            step.peak_reserved_bytes = torch.cuda.max_memory_reserved()
        if self._active:
            self._stop_activations()
            step.saved_bytes = sum(v[0] for v in step.by_module.values())
        return step

    def abort(self) -> None:
        """A step left open (the script failed inside it): take the hooks off, record nothing."""
        self._current = None
        if self._active:
            self._stop_activations()

    def _start_activations(self) -> None:
        from torch.autograd.graph import saved_tensors_hooks

        if _user_hooks_active():
            self._note(
                "activation memory not measured: the script's own saved-tensor hooks were active at a "
                "step's start (ours would have replaced them)"
            )
            return
        self._persistent = self._persistent_storages()
        self._seen = set()
        import torch

        self._in_backward = torch._C._current_graph_task_id  # -1 outside a backward pass
        self._compiling = torch.compiler.is_compiling
        self._hooks = saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        self._active = True

    def _stop_activations(self) -> None:
        self._active = False
        hooks, self._hooks = self._hooks, None
        top = _top_hooks()
        if top is not None and top[0] != self._pack:
            # The script pushed hooks inside the step and has not popped them: popping now would take
            # theirs off. Ours stay below theirs, inert (`_active` is False), until the script pops.
            self._note("activation memory: the script's saved-tensor hooks outlived a step; left in place")
            return
        hooks.__exit__(None, None, None)

    def _persistent_storages(self) -> set[int]:
        ptrs: set[int] = set()
        for ref in self._roots:
            root = ref()
            if root is None:
                continue
            for tensor in (*root.parameters(), *root.buffers()):
                try:
                    ptrs.add(tensor.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):  # sparse, meta or tensor subclasses
                    continue
        return ptrs

    def _note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    # ---- the hooks ----------------------------------------------------------------------------------------
    def _pack(self, tensor: Any) -> Any:
        if self._active and self._current is not None:
            self._count(tensor)
        return tensor.detach(), tensor._version

    def _count(self, tensor: Any) -> None:
        if self._in_backward() != -1 or self._compiling():
            return  # saved inside a backward (a recomputation) or while tracing: nothing held across the step
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr()
        if ptr in self._seen or ptr in self._persistent or not ptr:
            return
        self._seen.add(ptr)
        entry = self._current.by_module.setdefault(self._innermost(), [0, 0])
        entry[0] += storage.nbytes()
        entry[1] += 1


def _unpack(packed: Any) -> Any:
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected "
            f"version {version} instead. (Reported by opadvisor's saved-tensor hook, which measures "
            "activation memory while profiling.)"
        )
    return tensor


def _top_hooks() -> tuple[Any, Any] | None:
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # an older torch: cannot tell, assume none
        return None
    return top(True)


def _user_hooks_active() -> bool:
    return _top_hooks() is not None


def attach_memory(steps: list[Step], calls: list[ModuleCall], measured: list[StepMemory]) -> None:
    """Put what the recorder measured into the profile: per-step fields, and each module's activation
    memory as a mean per step over the steps where it was measured (a module that saved nothing in them
    gets 0; a module that saved but was never seen called, e.g. already running when the window
    started, gets a ModuleCall of its own)."""
    for step, mem in zip(steps, measured, strict=False):
        step.peak_allocated_bytes = mem.peak_allocated_bytes
        step.peak_reserved_bytes = mem.peak_reserved_bytes
        step.allocated_at_start_bytes = mem.allocated_at_start_bytes
        step.saved_bytes = mem.saved_bytes
    counted = [m for m in measured[: len(steps)] if m.saved_bytes is not None]
    if not counted:
        return
    totals: dict[tuple[str, str], list[int]] = {}
    for mem in counted:
        for key, (nbytes, count) in mem.by_module.items():
            if key is OUTSIDE:
                continue
            entry = totals.setdefault(key, [0, 0])
            entry[0] += nbytes
            entry[1] += count
    by_key = {(c.module, c.module_class): c for c in calls}
    for key in totals:
        if key not in by_key:
            by_key[key] = ModuleCall(module=key[0], module_class=key[1])
            calls.append(by_key[key])
    for key, call in by_key.items():
        nbytes, count = totals.get(key, (0, 0))
        call.saved_bytes = nbytes / len(counted)
        call.saved_tensors = count / len(counted)


# ---- reading it back: who holds the activation memory -----------------------------------------------


@dataclass
class Holder:
    """Activation memory one module (or one group of repeated blocks) holds per step.

    For a group of blocks (siblings `P.0`, `P.1`, ... of one class, e.g. the layers of a ModuleList) the
    bytes include everything their submodules saved; for a single module only what it saved itself (its
    submodules are holders of their own); `modules` is empty for what was saved outside every module.
    """

    name: str  # "blocks.0-11", "lm_head", "(outside modules)"
    module_class: str | None
    modules: list[str]
    saved_bytes: float  # mean per step
    input_bytes: int | None = None  # the blocks' tensor arguments (what a checkpoint of them keeps)

    @property
    def repeated(self) -> bool:
        return len(self.modules) > 1


def block_groups(calls: list[ModuleCall]) -> list[list[ModuleCall]]:
    """Groups of sibling modules `P.<i>` of one class (two or more), outermost groups only, each in
    index order: the repeated blocks of a model (transformer layers, residual stages)."""
    groups: dict[tuple[str, str], list[ModuleCall]] = {}
    for call in calls:
        parent, _, last = call.module.rpartition(".")
        if last.isdigit() and call.module:
            groups.setdefault((parent, call.module_class), []).append(call)
    found = [sorted(g, key=lambda c: int(c.module.rpartition(".")[2])) for g in groups.values() if len(g) > 1]
    members = {c.module for g in found for c in g}
    return [g for g in found if not any(_inside(g[0].module, m) for m in members if m != g[0].module)]


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path.startswith(ancestor + ".")


def inclusive_saved(calls: list[ModuleCall], path: str) -> float:
    """What `path` and all its submodules saved for backward, mean bytes per step."""
    return sum(c.saved_bytes or 0.0 for c in calls if c.module == path or _inside(c.module, path))


def group_name(paths: list[str]) -> str:
    """ "blocks.0" .. "blocks.11" -> "blocks.0-11" (a single path stays as it is)."""
    if len(paths) == 1:
        return paths[0]
    parent, _, first = paths[0].rpartition(".")
    last = paths[-1].rpartition(".")[2]
    return f"{parent}.{first}-{last}" if parent else f"{first}-{last}"


def activation_holders(profile: Profile) -> list[Holder]:
    """Who holds the step's activation memory, largest first: groups of repeated blocks (with their
    submodules), then single modules (their own tensors), then what was saved outside every module."""
    calls = [c for c in profile.module_calls if c.saved_bytes is not None]
    if not calls:
        return []
    holders: list[Holder] = []
    in_group: set[str] = set()
    for group in block_groups(calls):
        paths = [c.module for c in group]
        in_group.update(paths)
        holders.append(
            Holder(
                name=group_name(paths),
                module_class=group[0].module_class,
                modules=paths,
                saved_bytes=sum(inclusive_saved(calls, p) for p in paths),
                input_bytes=sum(c.input_bytes or 0 for c in group),
            )
        )
    for call in calls:
        if any(call.module == g or _inside(call.module, g) for g in in_group) or not call.saved_bytes:
            continue
        holders.append(
            Holder(
                call.module or "(model)", call.module_class, [call.module], call.saved_bytes, call.input_bytes
            )
        )
    measured = [s.saved_bytes for s in profile.steps if s.saved_bytes is not None]
    if measured:
        outside = sum(measured) / len(measured) - sum(c.saved_bytes or 0.0 for c in calls)
        if outside > 0:
            holders.append(Holder("(outside modules)", None, [], outside))
    return sorted(holders, key=lambda h: -h.saved_bytes)


def saved_per_step(profile: Profile) -> float | None:
    """Mean bytes saved for backward per step; None when not measured."""
    measured = [s.saved_bytes for s in profile.steps if s.saved_bytes is not None]
    return sum(measured) / len(measured) if measured else None


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"

"""The in-process profiling session: step detection, the recorded window, hooks, construction sites.

One `Session` is active while `opadvisor profile` runs a script. It installs, for the script's lifetime:
- a global optimizer step post hook: each `optimizer.step()` of the first optimizer that steps ends a
  training step (`opadvisor.step()` ends one explicitly and then takes over from the hook);
- global module forward hooks: NVTX ranges named by module path (readable in Nsight Systems), the map
  from module objects to their paths and classes, and the time-window fallback for scripts that never step;
- wrappers around the constructors of optimizers, DataLoaders, nn.Linear and nn.Embedding that record
  where the script built them (the fixes go there), and around nn.Module's that remember where each
  module was built, so that the model whose forward the script calls is recorded with the line that
  built or loaded it (`opadvisor apply` inserts `opadvisor.patch(model)` after it);
- inside the window, per step: CUDA peak memory and the activation memory each module saves for
  backward (`memory.MemoryRecorder`, fed the module stack by the forward hooks), and where each module
  was called from (`modules.ModuleCalls`).

The profiler runs only inside the window: after `warmup` steps it starts, records `steps` steps, stops,
and the session raises `WindowComplete` from the step boundary so a script meant to train for hours ends
(unless `run_to_end`).

A training framework's callback (opadvisor/integrations, through `recorder.WindowRecorder`) drives a
session with `step_source="callback"`: no optimizer hook and no time window; each of the framework's own
step events calls `callback_step()`, and the framework, not an exception, decides whether training stops.

Calibration: the last `calibrate` warm-up steps (never the first, which pays for initialisation) are timed
without the profiler: at each of their step ends the session synchronises CUDA (when the script uses it)
and reads the clock, as `opadvisor verify` times steps. The profiler's own per-op cost (the Python tracer,
shapes, stacks) stretches the host's share of a step; these plain times are what the step costs without it
(`Profile.calibration`; `suggest` scales the GPU idle time it reports to them).
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opadvisor.libraries import LOADERS
from opadvisor.profile.blocks import repeated_blocks
from opadvisor.profile.compiled import CompileRecorder
from opadvisor.profile.memory import MemoryRecorder, StepMemory
from opadvisor.profile.model import Calibration, Construction
from opadvisor.profile.modules import ModuleCalls
from opadvisor.profile.parallel import ParallelRecorder
from opadvisor.profile.quiet import without_usdt_lines
from opadvisor.profile.userframes import (
    construction_frame,
    innermost_library_frame,
    innermost_user_frame,
    library_file,
    note_search_path,
    resolve_user_file,
)
from opadvisor.profile.vendored import vendored_transformers_words


class WindowComplete(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised at the step boundary that completes the window, to end the user's script early.

    A BaseException so that the script's own `except Exception:` blocks do not swallow it.
    """


@dataclass
class SessionConfig:
    warmup: int = 3
    steps: int = 5
    run_to_end: bool = False
    # Fallback for scripts that never step: start recording after this many seconds of module
    # forwards with no step seen, and record for `window_seconds`.
    window_after_seconds: float = 5.0
    window_seconds: float = 2.0
    cuda: bool = False
    activations: bool = True  # measure the activation memory modules save for backward (saved-tensor hooks)
    memory_requested: bool = False  # `profile --memory`: the rules report memory findings whatever the peak
    # "script": steps found by the optimizer hook / opadvisor.step() / a time window (`opadvisor profile`);
    # "callback": only `Session.callback_step()` ends a step (a Trainer's own step events, integrations/)
    step_source: str = "script"
    calibrate: int = 3  # warm-up steps timed without the profiler (at most warmup - 1)
    # What the profiler records besides the ops (benchmarks/profiler_cost.py measures what each costs;
    # the rules need both: shapes for the chains, stacks for the source lines).
    record_shapes: bool = True
    with_stack: bool = True
    # Switch torch.compile off for the run (torch._dynamo.config.disable): compiled functions run their
    # Python eagerly, so the ops inside them are recorded with their source lines (`profile --eager`).
    eager: bool = False


@dataclass
class StepMark:
    index: int
    start_ns: int
    end_ns: int


@dataclass
class Recording:
    """What the window produced: the stopped profiler and the step intervals (perf_counter_ns)."""

    profiler: Any
    steps: list[StepMark] = field(default_factory=list)
    complete: bool = False


_active: Session | None = None


def active() -> Session | None:
    return _active


def mark_step() -> None:
    """`opadvisor.step()`: end a step explicitly (a no-op outside `opadvisor profile`)."""
    if _active is not None:
        _active.on_step(explicit=True)


class Session:
    def __init__(self, config: SessionConfig, on_progress: Callable[[int, int], None] | None = None):
        self.config = config
        self.on_progress = on_progress
        self.detection = "callback" if config.step_source == "callback" else "optimizer_hook"
        self.steps_seen = 0
        self.recording: Recording | None = None
        self.constructions: list[Construction] = []
        self.module_paths: dict[int, str] = {}
        self.module_types: dict[int, str] = {}  # id(module) -> qualified class
        self.modules: dict[str, str] = {}  # module path -> qualified class (the profile's `modules`)
        self._roots: list[Any] = []  # weak references to the outermost modules called
        self._modules_by_construction: dict[int, Construction] = {}
        self._built_at: Any = None  # WeakKeyDictionary: module -> (file, line, function, how)
        self._first_optimizer: int | None = None
        self._explicit = False
        self._profiler: Any = None
        self._step_start_ns: int | None = None
        self._step_fn: Any = None
        self._first_forward_s: float | None = None
        self._outer: int | None = None  # id of the first module called (the outermost), and its calls
        self._outer_calls = 0
        self._window_started_s: float | None = None
        self._undo: list[Callable[[], None]] = []
        self.warnings: list[str] = []
        self._nvtx: Any = None
        self._nvtx_step: Any = None
        self.memory = MemoryRecorder(cuda=config.cuda, activations=config.activations)
        self.step_memory: list[StepMemory] = []
        self.module_calls = ModuleCalls()
        self._class_names: dict[type, str] = {}
        # The profiled script's module, held until its profile is built: torch's Python tracer keeps the
        # names of the functions it saw without owning their code objects, and when runpy drops the script's
        # module they go with it; read afterwards they were garbage (seen with torch 2.13).
        self.keep_alive: list[Any] = []
        self._calibration_ns: list[
            int
        ] = []  # clock at the ends of the calibration steps (and the one before)
        self._calibration_synced = False
        self.compiles = CompileRecorder(lambda: self.steps_seen)
        self._decorator_kwargs: dict[str, Any] | None = None  # of the `@torch.compile(...)` being applied
        self.parallel = ParallelRecorder(self._add_construction, self.warnings)  # DDP / FSDP2 (issue 34)

    # ---- lifecycle -----------------------------------------------------------------------------
    def install(self) -> None:
        global _active
        import torch
        from torch.nn.modules import module as module_mod
        from torch.optim.optimizer import register_optimizer_step_post_hook

        try:
            import nvtx

            self._nvtx = nvtx
        except ImportError:  # nvtx is a dependency; without it the run still works, just without ranges
            self._nvtx = None

        # Our global forward hooks are ours, not the user's: torch's warning about them under
        # torch.compile(module) would only confuse (they do nothing while compiling).
        warnings.filterwarnings(
            "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
        )
        # torch warns that a profiler without acc_events keeps one cycle only; ours records one window
        # and reads it before anything could clear it.
        warnings.filterwarnings("ignore", message=r"(?s).*Profiler clears events at the end of each cycle")
        # torch.profiler's first start imports torch._inductor (`hasattr(torch, "_inductor")`: 1-3 s): pay
        # that now, not inside the script's run, where a time window or the script's own clock would lose it.
        import torch._inductor.config  # noqa: F401

        if self.config.step_source == "script":
            self._undo.append(register_optimizer_step_post_hook(self._optimizer_hook).remove)
        h2 = module_mod.register_module_forward_pre_hook(self._forward_pre_hook)
        h3 = module_mod.register_module_forward_hook(self._forward_post_hook, always_call=True)
        self._undo += [h2.remove, h3.remove]
        self._wrap_init(torch.optim.Optimizer, self._record_optimizer)
        self._wrap_init(torch.utils.data.DataLoader, self._record_dataloader)
        self._wrap_init(torch.nn.Linear, self._record_module)
        self._wrap_init(torch.nn.Embedding, self._record_module)
        if torch.distributed.is_available():
            from torch.nn.parallel import DistributedDataParallel

            self._wrap_init(DistributedDataParallel, self.parallel.record_ddp)
            self._undo.append(self.parallel.install())
        self._built_at = weakref.WeakKeyDictionary()
        self._wrap_init(torch.nn.Module, self._remember_site)
        if self.config.eager:
            self._disable_compile()
        else:
            self._undo.append(self.compiles.install())
            self._record_compile_calls()
        _active = self
        if self.config.warmup == 0:
            self._start_window()

    def _disable_compile(self) -> None:
        import torch._dynamo

        saved = torch._dynamo.config.disable
        torch._dynamo.config.disable = True
        self._undo.append(lambda: setattr(torch._dynamo.config, "disable", saved))

    def uninstall(self) -> None:
        global _active
        _active = None
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for path_id, construction in self._modules_by_construction.items():
            construction.module = self.module_paths.get(path_id)
        self.parallel.finish(self.module_paths, self._outer)

    def finish(self) -> Recording | None:
        """Stop a window still in progress (script ended or failed inside it); return what was recorded."""
        if self._profiler is not None:
            self._stop_window(complete=False)
        return self.recording

    # ---- step boundaries -----------------------------------------------------------------------
    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._explicit:
            return
        if self._first_optimizer is None:
            self._first_optimizer = id(optimizer)
        if id(optimizer) != self._first_optimizer:
            return  # a second optimizer (e.g. a GAN's) steps inside the same training step
        self.parallel.on_optimizer_step()
        self.on_step(explicit=False)

    def callback_step(self) -> None:
        """A step ended, as the training framework driving this session says (step_source "callback")."""
        self._advance()

    def on_step(self, *, explicit: bool) -> None:
        if self.config.step_source != "script":
            return  # the framework's step events end steps; opadvisor.step() would count them twice
        if explicit and not self._explicit:
            self._explicit = True
            self.detection = "explicit"
        if self.detection == "time_window":
            return
        self._advance()

    def _advance(self) -> None:
        """One step ended: open the window after the warm-up, close a recorded step, stop when done."""
        now = time.perf_counter_ns()
        self.steps_seen += 1
        if self._profiler is None and self.recording is None:
            self._mark_calibration()
        if self._profiler is not None and self._step_start_ns is not None:
            self._end_step_range(now)
            recorded = len(self.recording.steps) if self.recording else 0
            if self.on_progress:
                self.on_progress(recorded, self.config.steps)
            if recorded >= self.config.steps:
                self._stop_window(complete=True)
                if not self.config.run_to_end:
                    raise WindowComplete()
                return
            self._begin_step_range()
        elif self._profiler is None and self.recording is None and self.steps_seen == self.config.warmup:
            self._start_window()
        elif self.on_progress and self.recording is None:
            self.on_progress(0, self.config.steps)

    # ---- calibration ---------------------------------------------------------------------------------
    def calibration_steps(self) -> int:
        """How many warm-up steps are timed: `calibrate`, but never the first warm-up step."""
        return max(0, min(self.config.calibrate, self.config.warmup - 1))

    def _mark_calibration(self) -> None:
        """At a warm-up step end: take the clock when it starts or ends a calibration step."""
        first_mark = self.config.warmup - self.calibration_steps()
        if not self.calibration_steps() or self.steps_seen < first_mark:
            return
        import torch

        if self.config.cuda and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            self._calibration_synced = True
        self._calibration_ns.append(time.perf_counter_ns())

    def calibration(self) -> Calibration | None:
        """The calibration steps' times, None when no step was timed."""
        marks = self._calibration_ns
        if len(marks) < 2:
            return None
        return Calibration(
            step_ms=[round((b - a) / 1e6, 4) for a, b in zip(marks, marks[1:], strict=False)],
            method="cuda_sync" if self._calibration_synced else "wall",
        )

    def _start_window(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        kwargs: dict[str, Any] = {}
        if self.config.cuda:
            activities.append(ProfilerActivity.CUDA)
            from torch.profiler import _ExperimentalConfig

            kwargs["experimental_config"] = _ExperimentalConfig(enable_cuda_sync_events=True)
        self.keep_alive.append(sys.modules.get("__main__"))
        self._profiler = profile(
            activities=activities,
            record_shapes=self.config.record_shapes,
            with_stack=self.config.with_stack,
            **kwargs,
        )
        if self.config.cuda:
            torch.cuda.synchronize()
        with without_usdt_lines():
            self._profiler.start()
        self.recording = Recording(profiler=self._profiler)
        self._begin_step_range()

    def _begin_step_range(self) -> None:
        import torch

        index = len(self.recording.steps) if self.recording else 0
        self._step_fn = torch.autograd.profiler.record_function(f"ProfilerStep#{index}")
        self._step_fn.__enter__()
        if self._nvtx is not None:
            self._nvtx_step = self._nvtx.start_range(message=f"step {index}", domain="opadvisor")
        self.memory.start_step()
        self._step_start_ns = time.perf_counter_ns()

    def _end_step_range(self, now_ns: int) -> None:
        assert self.recording is not None and self._step_start_ns is not None
        self.step_memory.append(self.memory.end_step())
        if self._step_fn is not None:
            self._step_fn.__exit__(None, None, None)
            self._step_fn = None
        if self._nvtx is not None and self._nvtx_step is not None:
            self._nvtx.end_range(self._nvtx_step)
            self._nvtx_step = None
        index = len(self.recording.steps)
        self.recording.steps.append(StepMark(index, self._step_start_ns, now_ns))
        self._step_start_ns = None

    def _stop_window(self, *, complete: bool) -> None:
        import torch

        if self._step_fn is not None:  # a step left open by a failure or the end of the script
            self._step_fn.__exit__(None, None, None)
            self._step_fn = None
            self.memory.abort()
        if self.config.cuda:
            torch.cuda.synchronize()
        note_search_path()  # the profiler shortens its file names by sys.path as it is now, in the script
        with without_usdt_lines():
            self._profiler.stop()
        self._profiler = None
        self._step_start_ns = None
        assert self.recording is not None
        self.recording.complete = complete

    # ---- module hooks ----------------------------------------------------------------------------
    def _forward_pre_hook(self, module: Any, args: Any) -> None:
        if _compiling():
            return  # inside torch.compile tracing: add nothing to the graph (no breaks, no side effects)
        key = id(module)
        if key not in self.module_paths:
            self._register_paths(module)
        path = self.module_paths.get(key, "")
        if self._nvtx is not None:
            self._nvtx.push_range(message=path or type(module).__name__, domain="opadvisor")
        cls = self._class_name(type(module))
        self.memory.enter((path, cls))  # always paired with the post hook's exit, window or not
        if self._profiler is not None:
            self.module_calls.on_call(module, path, cls, args)
        if self._outer is None:
            self._outer = key
        if key == self._outer:
            self._outer_calls += 1
        if self.parallel.watches(key):
            self.parallel.on_wrapper_forward(module)
        self._check_time_window()

    def _forward_post_hook(self, module: Any, args: Any, output: Any) -> None:
        if _compiling():
            return
        self.memory.exit()
        if self._nvtx is not None:
            self._nvtx.pop_range(domain="opadvisor")

    def _class_name(self, cls: type) -> str:
        name = self._class_names.get(cls)
        if name is None:
            name = self._class_names[cls] = _public_name(cls, "torch.nn")
        return name

    def _register_paths(self, root: Any) -> None:
        """Name every submodule of the first unknown module called: it is the outermost one."""
        self.memory.add_root(root)
        first = not self.module_paths
        import weakref

        try:
            self._roots.append(weakref.ref(root))
        except TypeError:  # a module class that refuses weak references: its tensors stay unnamed
            pass
        for name, sub in root.named_modules():
            # torch.compile(model) wraps the model: name its modules as the user's model names them
            name = ".".join(part for part in name.split(".") if part != "_orig_mod")
            self.module_paths.setdefault(id(sub), name)
            qualified = _qualified(type(sub))
            self.module_types.setdefault(id(sub), qualified)
            self.modules.setdefault(name, qualified)
        if first:
            try:
                self._record_model(root)
            except Exception as exc:  # recording a site must never break the user's script
                self.warnings.append(f"could not record where the model was built: {exc}")

    def _check_time_window(self) -> None:
        if self.config.step_source != "script":
            return  # a framework's step events drive the window; its warm-up may be long, never a time window
        if self.steps_seen or self.recording is not None and self.detection != "time_window":
            return
        now = time.monotonic()
        if self._first_forward_s is None:
            self._first_forward_s = now
            return
        if self._window_started_s is None:
            # Only once the model was called again without a step: a first step can take longer than
            # window_after_seconds by itself (torch.compile compiling it) and still end in optimizer.step().
            if now - self._first_forward_s >= self.config.window_after_seconds and self._outer_calls >= 2:
                self.detection = "time_window"
                self._window_started_s = now
                self._start_window()
            return
        if self._profiler is not None and now - self._window_started_s >= self.config.window_seconds:
            self._end_step_range(time.perf_counter_ns())
            self._stop_window(complete=True)
            if not self.config.run_to_end:
                raise WindowComplete()

    def tensor_kinds(self) -> dict[int, str]:
        """TensorImpl address -> "param" | "frozen" | "buffer" for the tensors of the modules called.

        The profiler records each tensor input's TensorImpl address (`impl_ptr`), which is `Tensor._cdata`:
        so the profile can say which operand of an op is a parameter, and whether it requires grad.
        """
        kinds: dict[int, str] = {}
        for ref in self._roots:
            root = ref()
            if root is None:
                continue
            for buffer in root.buffers():
                kinds.setdefault(buffer._cdata, "buffer")
            for param in root.parameters():
                kinds.setdefault(param._cdata, "param" if param.requires_grad else "frozen")
        return kinds

    # ---- construction sites ------------------------------------------------------------------------
    def _wrap_init(self, cls: type, record: Callable[[Any, tuple, dict], None]) -> None:
        original = cls.__init__

        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            original(obj, *args, **kwargs)
            try:
                record(obj, args, kwargs)
            except Exception as exc:  # recording a site must never break the user's script
                self.warnings.append(f"could not record where a {cls.__name__} was built: {exc}")

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = __init__  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(cls, "__init__", original))

    def _add_construction(self, kind: str, obj: Any, package: str, attrs: dict[str, Any]) -> Construction:
        """Record that the user's code (its innermost frame on the stack) just built `obj`."""
        frame = innermost_user_frame()
        file, line, function = frame if frame is not None else (None, None, None)
        construction = Construction(
            kind=kind,
            cls=_public_name(type(obj), package),
            file=file,
            line=line,
            function=function,
            attrs=attrs,
        )
        lib = innermost_library_frame()
        if lib is not None:
            site, lib_line = lib
            construction.lib_file, construction.lib_line = site.file.rel, lib_line
            construction.lib_function = site.function
        self.constructions.append(construction)
        return construction

    def _remember_site(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Every nn.Module: the user's line that built it (the model's site is chosen at its first call)."""
        if module in self._built_at:
            return  # nn.Module.__init__ ran again for the same object (a subclass calling it twice)
        found = construction_frame(module)
        if found is None:
            return
        frame, libraries = found
        how = next((name.lstrip("_") for name in libraries if name in LOADERS), "constructor")
        self._built_at[module] = (*frame, how)

    def _record_compile_calls(self) -> None:
        """Wrap `torch.compile` for the run: where the user's code compiled what (kind "compile")."""
        import torch

        original = torch.compile

        @functools.wraps(original)
        def compile(*args: Any, **kwargs: Any) -> Any:
            try:
                self._record_compile(args, kwargs)
            except Exception as exc:  # recording a site must never break the user's script
                self.warnings.append(f"could not record where torch.compile was called: {exc}")
            return original(*args, **kwargs)

        torch.compile = compile  # type: ignore[assignment]
        self._undo.append(lambda: setattr(torch, "compile", original))

    def _record_compile(self, args: tuple, kwargs: dict) -> None:
        caller = sys._getframe(2)
        by_user = resolve_user_file(caller.f_code.co_filename) is not None
        if not by_user and not caller.f_code.co_filename.endswith(
            (MODULE_COMPILE_FILE, DECORATOR_COMPILE_FILE)
        ):
            return  # torch compiling its own helpers (flex attention, ...), not the user's code
        target = args[0] if args else kwargs.get("model")
        if target is None:
            # `@torch.compile(...)`: torch calls this again with the decorated function and every
            # keyword at its default; the user's own keywords are these
            self._decorator_kwargs = dict(kwargs)
            return
        if caller.f_code.co_filename.endswith(DECORATOR_COMPILE_FILE) and self._decorator_kwargs is not None:
            kwargs, self._decorator_kwargs = self._decorator_kwargs, None
        frame = innermost_user_frame(skip=2)
        if frame is None:
            return
        attrs: dict[str, Any] = {k: _shown(v) for k, v in kwargs.items() if k != "model"}
        attrs.update(compiled_code(target))
        blocks = _compiled_module_blocks(target)
        if blocks is not None:
            attrs["blocks"] = blocks
        self.constructions.append(Construction("compile", "torch.compile", *frame, attrs=attrs))

    def _record_model(self, root: Any) -> None:
        """The model whose forward the script calls: where it was built, how, and its library switches."""
        model = _unwrap(root)
        site = self._built_at.get(model) if self._built_at is not None else None
        if site is None:
            return
        file, line, function, how = site
        cls = _unsharded_class(type(model))
        lib = library_file(getattr(sys.modules.get(cls.__module__), "__file__", None) or "")
        attrs: dict[str, Any] = {"how": how, "package": lib.package if lib is not None else None}
        config = getattr(model, "config", None)
        attn = getattr(config, "_attn_implementation", None)
        if isinstance(attn, str):
            attrs["attn_implementation"] = attn
            # whether transformers' attention switch can give this model SDPA (rules/_library.py)
            attrs["supports_sdpa"] = bool(getattr(cls, "_supports_sdpa", False))
        self.constructions.append(
            Construction("model", _qualified(cls), file, line, function, module="", attrs=attrs)
        )
        vendored = vendored_transformers_words(cls)
        if vendored is not None:
            self.warnings.append(vendored)

    def _record_optimizer(self, opt: Any, args: tuple, kwargs: dict) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        self._add_construction(
            "optimizer",
            opt,
            "torch.optim",
            {
                "fused": opt.defaults.get("fused"),
                "foreach": opt.defaults.get("foreach"),
                "lr": _plain(opt.defaults.get("lr")),
                "param_count": len(params),
                "param_devices": sorted({p.device.type for p in params}),
                "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            },
        )

    def _record_dataloader(self, loader: Any, args: tuple, kwargs: dict) -> None:
        dataset = loader.dataset
        try:
            length = len(dataset)
        except TypeError:
            length = None
        self._add_construction(
            "dataloader",
            loader,
            "torch.utils.data",
            {
                "batch_size": loader.batch_size,
                "num_workers": loader.num_workers,
                "pin_memory": loader.pin_memory,
                "persistent_workers": loader.persistent_workers,
                "dataset": type(dataset).__name__,
                "dataset_len": length,
            },
        )

    def _record_module(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if isinstance(module, torch.nn.Linear):
            attrs = {
                "in_features": module.in_features,
                "out_features": module.out_features,
                "bias": module.bias is not None,
            }
        else:
            attrs = {
                "num_embeddings": module.num_embeddings,
                "embedding_dim": module.embedding_dim,
                "padding_idx": module.padding_idx,
            }
        construction = self._add_construction("module", module, "torch.nn", attrs)
        self._modules_by_construction[id(module)] = construction


# torch calls torch.compile for the user from these: nn.Module.compile, and the decorator that
# `@torch.compile(...)` returns
MODULE_COMPILE_FILE = "torch/nn/modules/module.py"
DECORATOR_COMPILE_FILE = "torch/__init__.py"


def compiled_code(target: Any) -> dict[str, Any]:
    """What torch.compile was given: its qualified name and the file and first line of the code it
    compiles (a module's forward), so the frames dynamo compiled can be matched to the call."""
    import inspect

    import torch

    fn = getattr(target, "__func__", target)
    if isinstance(fn, torch.nn.Module):
        fn = type(fn).forward
    elif getattr(fn, "__name__", "") == "_call_impl" and isinstance(
        getattr(target, "__self__", None), torch.nn.Module
    ):
        fn = type(target.__self__).forward  # nn.Module.compile hands torch.compile its own _call_impl
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    return {
        "target": getattr(fn, "__qualname__", type(target).__name__),
        "code_file": resolve_user_file(code.co_filename) if code is not None else None,
        "code_line": code.co_firstlineno if code is not None else None,
    }


def _compiled_module_blocks(target: Any) -> dict[str, Any] | None:
    """The repeated blocks of a module compiled whole (`torch.compile(model)`, `model.compile()`)."""
    import torch

    module = (
        getattr(target, "__self__", target) if getattr(target, "__name__", "") == "_call_impl" else target
    )
    return repeated_blocks(module) if isinstance(module, torch.nn.Module) else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _qualified(cls: type) -> str:
    cls = _unsharded_class(cls)
    return f"{cls.__module__}.{cls.__qualname__}"


_FSDP_PACKAGE = "torch.distributed.fsdp"


def _unsharded_class(cls: type) -> type:
    """The user's class of a module FSDP2 wrapped: `fully_shard` swaps its class for a subclass
    `FSDP<Name>(FSDPModule, Name)` made in torch's own module, which would read as torch's code."""
    if cls.__name__.startswith("FSDP") and cls.__module__.startswith(_FSDP_PACKAGE):
        return next((b for b in cls.__bases__ if not b.__module__.startswith(_FSDP_PACKAGE)), cls)
    return cls


def _unwrap(module: Any) -> Any:
    """The user's model inside torch.compile's and DistributedDataParallel's wrappers."""
    for _ in range(4):
        inner = getattr(module, "_orig_mod", None)
        if inner is None and type(module).__name__ in ("DistributedDataParallel", "DataParallel"):
            inner = getattr(module, "module", None)
        if inner is None:
            return module
        module = inner
    return module


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def _public_name(cls: type, package: str) -> str:
    """`torch.optim.adamw.AdamW` -> `torch.optim.AdamW` when the package exports it; user classes as is."""
    import importlib

    cls = _unsharded_class(cls)

    try:
        if getattr(importlib.import_module(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    except ImportError:
        pass
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)

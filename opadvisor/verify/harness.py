"""The child side of `opadvisor verify`: run a training script for N steps and record its losses and step times.

Run as `python -m opadvisor.verify.harness` with the environment variable `OPADVISOR_VERIFY_CONFIG` naming a
JSON file (written by `opadvisor.verify.runner`):

    {"script": absolute path, "argv": [argv0, ...], "cwd": str, "steps": int, "warmup": int,
     "mode": "parity" | "timing", "seed": int, "result": path of the JSON this process writes,
     "sources": {absolute path: path of the source to run instead},
     "module": dotted name or null (run as `python -m` runs it), "import_root": its sys.path[0] or null,
     "grads_dir": folder for the step-1 gradients (parity mode; optional)}

The user's script is not edited. The harness, inside this process, before the script runs:

- Seeds `random`, `numpy` (when installed) and torch with `seed`; the script normally seeds itself too.
- Serves the original program where asked: every file named in `sources` (the byte-exact backups that
  `opadvisor apply` kept) is compiled from the backup under its original filename, the main script
  directly, imported modules through a meta path finder placed first on `sys.meta_path`. `__file__`,
  tracebacks and `linecache` see the original path with the backup's lines.
- Marks step ends with a global optimizer step post hook (`register_optimizer_step_post_hook`). The first
  optimizer that steps leads: a step ends each time it steps, so a script with two optimizers (a GAN)
  still counts one step per iteration. `opadvisor.step()` counts only in a script without an optimizer.
  After `steps` steps (warmup + steps in timing mode) the hook raises `StopScript`, a BaseException, which
  ends the script there: a script meant to run for hours stops after the steps verify needs.
- Records the loss of each step: the value of every backward started on a one-element tensor
  (`Tensor.backward` and `torch.autograd.backward` are wrapped; the nested call is not counted twice).
  A step's first such value is its loss; all of them are compared (gradient accumulation).

Parity mode (losses must match between original and rewrite):
- Dropout is neutralised, because dropout is random and the two programs draw their masks differently:
  every `nn.Dropout*` module gets p=0 (a global forward pre hook), `torch.nn.functional.dropout*`,
  `torch.dropout` and `scaled_dot_product_attention` run with p=0, and every public function of
  `opadvisor.kernels` with a `p` / `dropout_p` parameter is called with 0.
- Deterministic algorithms where torch has them (`use_deterministic_algorithms(True, warn_only=True)`,
  cuDNN deterministic, no cuDNN benchmark; the parent sets `CUBLAS_WORKSPACE_CONFIG`).
- The global gradient norm of the lead optimizer's parameters is recorded at step 1 (an optimizer step
  pre hook, so after GradScaler's unscale), and every parameter's gradient is written to `grads_dir`
  (`grads.save_gradients`; names from the modules the first step ran).
- The work of the first step, for the tolerances (`tolerance.py`): the longest reduction (the largest
  input feature count or row count of a module with parameters) and the depth (modules with parameters).
- The precision in use is recorded (autocast dtype, low-precision parameters, TF32 matmuls), seen from a
  module forward pre hook during the first step; the parent picks its tolerance from it.

Timing mode (normal settings): at each step end the harness synchronises CUDA (when the script uses it) and
reads `time.perf_counter()`; step k lasts from the end of step k-1 to the end of step k, so every step after
the first has a duration; the parent drops the warm-up steps. On CUDA each step also records its peak
memory (`torch.cuda.max_memory_allocated` / `max_memory_reserved`, reset at every step end).

The result JSON: {"schema": 1, "mode", "steps": [{"index": 1-based, "losses": [float], "end_s": float,
"peak_allocated_bytes": int, "peak_reserved_bytes": int (timing mode on CUDA only)}],
"grad_norm": float | null, "precision": "fp32" | "tf32" | "bf16" | "fp16", "device": "cpu" | "cuda",
"stopped": bool (reached the step count), "exit": "stopped" | "finished" | "error", "error": str | null,
"served": [realpath of each file of `sources` that was run from its replacement],
"work": {"reduction": int, "depth": int} (parity mode), "gradients": grads_dir or null,
"dispatch": {"imported": bool, "record": bool, "counts": {op: {path: calls}}}: which implementation each
fused call of `opadvisor.kernels` ran (`dispatch_counts()`; "record" is False for kernels without it),
"compiled" (timing with verify --compile only): {"module": class name, "backend": str} or {"skipped": why}}.
The process exits 0 unless the script raised (3) or the harness itself failed (4).
"""

from __future__ import annotations

import builtins
import functools
import importlib.abc
import importlib.util
import inspect
import json
import linecache
import math
import os
import random
import sys
import time
import traceback
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG_ENV = "OPADVISOR_VERIFY_CONFIG"
RESULT_SCHEMA = 1
EXIT_SCRIPT_ERROR = 3
EXIT_HARNESS_ERROR = 4

_PRECISION_RANK = {"fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3}


class StopScript(BaseException):
    """Raised from the optimizer hook once enough steps ran; ends the user's script where it is."""


# ---- the original program: sources served from backups ------------------------------------------------


def _install_source(path: str, source: bytes) -> None:
    """Make linecache (tracebacks, inspect) show `source` for `path`; mtime None keeps it from being checked."""
    text = source.decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    linecache.cache[path] = (len(text), None, lines, path)


class _BackupLoader(importlib.abc.Loader):
    def __init__(self, origin: str, source: bytes) -> None:
        self.origin = origin
        self.source = source

    def create_module(self, spec: Any) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        _install_source(self.origin, self.source)
        code = compile(self.source, self.origin, "exec", dont_inherit=True)
        exec(code, module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.source.decode("utf-8", errors="replace")


class BackupFinder(importlib.abc.MetaPathFinder):
    """Serve modules whose file is in `sources` from the replacement source, keeping the original path."""

    def __init__(self, sources: dict[str, bytes]) -> None:
        self.sources = {os.path.realpath(k): v for k, v in sources.items()}
        self.served: list[str] = []  # the files served from their replacement, in import order

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or not spec.has_location or not spec.origin:
            return None
        source = self.sources.get(os.path.realpath(spec.origin))
        if source is None:
            return None  # let the normal machinery import it
        self.served.append(os.path.realpath(spec.origin))
        return importlib.util.spec_from_file_location(
            fullname,
            spec.origin,
            loader=_BackupLoader(spec.origin, source),
            submodule_search_locations=spec.submodule_search_locations,
        )


# ---- recording ----------------------------------------------------------------------------------------


class Recorder:
    """Counts steps, records losses, step end times, the step-1 gradient norm and the precision in use."""

    def __init__(self, steps: int, mode: str, grads_dir: str | None = None) -> None:
        self.limit = steps
        self.mode = mode
        self.grads_dir = grads_dir
        self.grads_saved = False
        self.names: dict[int, str] = {}  # id(parameter) -> its name in the outermost module called
        self._named_modules: set[int] = set()
        self._param_modules: set[int] = set()  # modules with parameters the first step ran
        self.reduction = 1
        self.steps: list[dict[str, Any]] = []
        self.pending: list[float] = []  # losses of the step in progress
        self.grad_norm: float | None = None
        self.precision = "fp32"
        self.device = "cpu"
        self.lead: weakref.ref | None = None
        self.saw_optimizer = False
        self.in_backward = 0

    # -- losses
    def record_loss(self, tensor: Any) -> None:
        if self.mode != "parity":
            return
        value = float(tensor.detach().float().reshape(()).item())
        self.pending.append(value)

    # -- precision, seen from module forwards during the first step
    def note_precision(self, module: Any) -> None:
        import torch

        seen = []
        for device_type in ("cuda", "cpu"):
            try:
                if torch.is_autocast_enabled(device_type):
                    seen.append(
                        {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
                            torch.get_autocast_dtype(device_type), "fp32"
                        )
                    )
            except (TypeError, RuntimeError, AttributeError):  # older torch: no device_type argument
                pass
        for param in module.parameters(recurse=False):
            if param.dtype in (torch.bfloat16, torch.float16):
                seen.append("bf16" if param.dtype == torch.bfloat16 else "fp16")
            elif param.is_cuda and param.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
                seen.append("tf32")
        for p in seen:
            if _PRECISION_RANK[p] > _PRECISION_RANK[self.precision]:
                self.precision = p

    # -- names and the work of the first step
    def note_module(self, module: Any, args: Any) -> None:
        import torch

        if id(module) not in self._named_modules:  # the outermost module called: name every parameter
            self._named_modules.update(id(sub) for sub in module.modules())
            for name, p in module.named_parameters():
                self.names.setdefault(id(p), name)
        if next(module.parameters(recurse=False), None) is None:
            return
        self._param_modules.add(id(module))
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and x.dim() >= 1 and x.shape[-1] > 0:
            self.reduction = max(self.reduction, int(x.shape[-1]), int(x.numel() // x.shape[-1]))

    def work(self) -> dict[str, int]:
        return {"reduction": self.reduction, "depth": len(self._param_modules)}

    # -- steps
    def _is_lead(self, optimizer: Any) -> bool:
        if self.lead is None or self.lead() is None:
            self.lead = weakref.ref(optimizer)
        return self.lead() is optimizer

    def before_optimizer_step(self, optimizer: Any) -> None:
        if self.mode != "parity" or self.steps or not self._is_lead(optimizer):
            return

        total = 0.0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    total += float(local_shard(p.grad.detach()).float().pow(2).sum().item())
        self.grad_norm = math.sqrt(total)
        if self.grads_dir is not None:
            from opadvisor.verify.grads import save_gradients

            save_gradients(optimizer, self.names, Path(self.grads_dir))
            self.grads_saved = True

    def after_optimizer_step(self, optimizer: Any) -> None:
        self.saw_optimizer = True
        if self._is_lead(optimizer):
            self.end_step()

    def explicit_step(self) -> None:
        if not self.saw_optimizer:
            self.end_step()

    def end_step(self) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device = "cuda"
            if self.mode == "timing":
                torch.cuda.synchronize()
        step = {"index": len(self.steps) + 1, "losses": self.pending, "end_s": time.perf_counter()}
        if self.device == "cuda" and self.mode == "timing":
            # this step's peaks (the counters are reset at every step end), read after the time is taken
            step["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            step["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        self.steps.append(step)
        self.pending = []
        if len(self.steps) >= self.limit:
            raise StopScript


# ---- patches --------------------------------------------------------------------------------------------


def _force_zero(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any] | None:
    """Wrap fn so that its dropout-probability parameter (the first of `names` it has) is always 0."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    name = next((n for n in names if n in sig.parameters), None)
    if name is None:
        return None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs)
        bound.arguments[name] = 0.0
        return fn(*bound.args, **bound.kwargs)

    return wrapper


def _sdpa_without_dropout(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    wrapper.__wrapped__ = sdpa  # type: ignore[attr-defined]
    wrapper.__name__ = "scaled_dot_product_attention"
    return wrapper


def neutralise_dropout() -> list[str]:
    """Make every dropout the harness knows of a no-op; returns what was patched (for the result)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.modules.dropout import _DropoutNd

    def zero_dropout_modules(module: Any, args: Any) -> None:
        if isinstance(module, _DropoutNd) and module.p != 0:
            module.p = 0.0

    torch.nn.modules.module.register_module_forward_pre_hook(zero_dropout_modules)
    patched = ["nn.Dropout modules"]
    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        fn = getattr(F, name, None)
        wrapped = _force_zero(fn, ("p",)) if fn is not None else None
        if wrapped is not None:
            setattr(F, name, wrapped)
            patched.append(f"F.{name}")
    for name in ("dropout", "dropout_", "alpha_dropout", "feature_dropout", "feature_alpha_dropout"):
        fn = getattr(torch, name, None)
        if fn is not None:
            orig = fn
            setattr(torch, name, lambda input, p, train, _f=orig: _f(input, 0.0, train))
            patched.append(f"torch.{name}")
    F.scaled_dot_product_attention = _sdpa_without_dropout(F.scaled_dot_product_attention)
    patched.append("F.scaled_dot_product_attention")
    patched.extend(_neutralise_kernel_dropout())
    return patched


def _neutralise_kernel_dropout() -> list[str]:
    """Call opadvisor.kernels' public functions with dropout p = 0, in the package and its submodules."""
    try:
        import opadvisor.kernels  # noqa: F401
    except Exception:  # noqa: BLE001 - no kernels (e.g. no triton): nothing to patch
        return []
    patched = []
    replaced: dict[int, Callable[..., Any]] = {}
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (
            mod_name == "opadvisor.kernels" or mod_name.startswith("opadvisor.kernels.")
        ):
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") or not inspect.isfunction(value):
                continue
            if id(value) not in replaced:
                wrapped = _force_zero(value, ("dropout_p", "p", "dropout"))
                if wrapped is None:
                    continue
                replaced[id(value)] = wrapped
                patched.append(f"{value.__module__}.{value.__name__}")
            setattr(module, attr, replaced[id(value)])
    return sorted(set(patched))


def make_deterministic() -> None:
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def install_hooks(rec: Recorder) -> None:
    import torch
    import torch.optim.optimizer as optim_mod

    import opadvisor

    optim_mod.register_optimizer_step_pre_hook(lambda opt, args, kwargs: rec.before_optimizer_step(opt))
    optim_mod.register_optimizer_step_post_hook(lambda opt, args, kwargs: rec.after_optimizer_step(opt))
    opadvisor.step = rec.explicit_step  # scripts that mark steps themselves

    tensor_backward = torch.Tensor.backward
    autograd_backward = torch.autograd.backward

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not rec.in_backward and self.numel() == 1:
            rec.record_loss(self)
        rec.in_backward += 1
        try:
            return tensor_backward(self, *args, **kwargs)
        finally:
            rec.in_backward -= 1

    def functional_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not rec.in_backward:
            seq = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            if len(seq) == 1 and seq[0].numel() == 1:
                rec.record_loss(seq[0])
        rec.in_backward += 1
        try:
            return autograd_backward(tensors, *args, **kwargs)
        finally:
            rec.in_backward -= 1

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    torch.autograd.backward = functional_backward

    if rec.mode == "parity":

        def precision_hook(module: Any, args: Any) -> None:
            if not rec.steps:
                rec.note_precision(module)
                rec.note_module(module, args)

        torch.nn.modules.module.register_module_forward_pre_hook(precision_hook)


def install_compile(backend: str, result: dict[str, Any]) -> None:
    """verify --compile: the first module with trainable parameters the script calls (its model, or the
    DDP/FSDP wrapper around it) is compiled in place (`nn.Module.compile`) at that first call, which itself
    runs eagerly (the first-call checks of `opadvisor.patch` run there); `result["compiled"]` says what. A
    model the script compiles itself is left as it is."""
    import torch

    def compile_the_model(module: Any, args: Any) -> None:
        if not any(p.requires_grad for p in module.parameters()):
            return
        handle.remove()  # the hooks of this call were copied out already: removing it here is safe
        if torch.compiler.is_compiling() or isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            result["compiled"] = {"skipped": "the script compiles its model itself"}
            return
        module.compile(backend=backend)
        result["compiled"] = {"module": type(module).__name__, "backend": backend}

    handle = torch.nn.modules.module.register_module_forward_pre_hook(compile_the_model)


def dispatch_record() -> dict[str, Any]:
    """Which implementation each fused call ran, from `opadvisor.kernels.dispatch_counts()`."""
    kernels = sys.modules.get("opadvisor.kernels")
    counts = getattr(kernels, "dispatch_counts", None)
    return {
        "imported": kernels is not None,
        "record": counts is not None,
        "counts": counts() if counts is not None else {},
    }


def rank_result_path(result: str, rank: int) -> str:
    """Where rank `rank` writes its result: rank 0 (and a single process) at `result`, the others beside it."""
    return result if rank == 0 else f"{result}.rank{rank}"


def local_shard(tensor: Any) -> Any:
    """A DTensor's local shard (FSDP2's sharded gradients: each rank compares its own); other tensors as is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


# ---- running the script ---------------------------------------------------------------------------------


def run_script(
    script: str, argv: list[str], source: bytes, module: str | None = None, import_root: str | None = None
) -> None:
    """Run `source` as `__main__` with `__file__` = script (what `python script.py` would do); with
    `module`, what `python -m module` would do from `import_root`: its package imported first, and
    `__package__` / `__spec__` set, so that its relative imports resolve."""
    main = types.ModuleType("__main__")
    package = module.rpartition(".")[0] if module else None
    main.__dict__.update(
        {
            "__file__": script,
            "__builtins__": builtins,
            "__spec__": importlib.util.spec_from_loader(module, None, origin=script) if module else None,
            "__loader__": None,
            "__package__": package,
            "__cached__": None,
        }
    )
    _install_source(script, source)
    code = compile(source, script, "exec", dont_inherit=True)
    saved_main, saved_argv, saved_path0 = sys.modules.get("__main__"), sys.argv, sys.path[0]
    sys.modules["__main__"] = main
    sys.argv = list(argv)
    sys.path[0] = import_root if module and import_root else os.path.dirname(script)
    try:
        if package:
            importlib.import_module(package)
        exec(code, main.__dict__)
    finally:
        sys.argv, sys.path[0] = saved_argv, saved_path0
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def main() -> int:
    config_path = os.environ.get(CONFIG_ENV)
    if not config_path:
        print(f"opadvisor.verify.harness: {CONFIG_ENV} is not set", file=sys.stderr)
        return EXIT_HARNESS_ERROR
    cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
    os.chdir(cfg["cwd"])
    finder, script, script_source = _program_sources(cfg)
    mode = cfg["mode"]
    total = cfg["steps"] + (cfg.get("warmup", 0) if mode == "timing" else 0)
    rank = int(os.environ.get("RANK", "0"))  # under torchrun (a multi-rank verify): each rank its own file
    grads_dir = cfg.get("grads_dir") if mode == "parity" and rank == 0 else None
    rec = Recorder(total, mode, grads_dir)
    result: dict[str, Any] = {"schema": RESULT_SCHEMA, "mode": mode, "error": None, "dropout_patched": []}
    seed_everything(int(cfg.get("seed", 0)))
    if mode == "parity":
        make_deterministic()
        result["dropout_patched"] = neutralise_dropout()
    install_hooks(rec)
    if cfg.get("compile_backend"):
        install_compile(cfg["compile_backend"], result)
    exit_code = _run_program(cfg, script, script_source, result)
    result.update(
        steps=rec.steps,
        grad_norm=rec.grad_norm,
        precision=rec.precision,
        device=rec.device,
        stopped=len(rec.steps) >= total,
        served=finder.served,
        work=rec.work() if mode == "parity" else None,
        gradients=rec.grads_dir if rec.grads_saved else None,
        dispatch=dispatch_record(),
    )
    target = Path(rank_result_path(cfg["result"], rank))
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(target)
    return exit_code


def _program_sources(cfg: dict[str, Any]) -> tuple[BackupFinder, str, bytes]:
    """The program's files as the config names them (the original's from the backups), served ahead of the
    files on disk; (the finder, the script, the script's source)."""
    finder = BackupFinder(
        {path: Path(backup).read_bytes() for path, backup in cfg.get("sources", {}).items()}
    )
    if finder.sources:
        sys.meta_path.insert(0, finder)
    script = cfg["script"]
    script_source = finder.sources.get(os.path.realpath(script))
    if script_source is None:
        script_source = Path(script).read_bytes()
    else:
        finder.served.append(os.path.realpath(script))
    return finder, script, script_source


def _run_program(cfg: dict[str, Any], script: str, script_source: bytes, result: dict[str, Any]) -> int:
    """Run the script to its end or to the recorder's stop; how it ended goes into `result`; the exit code."""
    exit_code = 0
    try:
        run_script(script, cfg["argv"], script_source, cfg.get("module"), cfg.get("import_root"))
        result["exit"] = "finished"
    except StopScript:
        result["exit"] = "stopped"
    except SystemExit as exc:
        if exc.code in (None, 0):
            result["exit"] = "finished"
        else:
            result["exit"] = "error"
            result["error"] = f"the script exited with status {exc.code!r}"
            exit_code = EXIT_SCRIPT_ERROR
    except Exception:  # noqa: BLE001 - the user's script failed: report it
        result["exit"] = "error"
        result["error"] = traceback.format_exc(limit=-8)
        exit_code = EXIT_SCRIPT_ERROR
    return exit_code


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        code = EXIT_HARNESS_ERROR
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter shutdown: the stopped script may leave DataLoader workers or threads behind.
    os._exit(code)

"""opadvisor.kernels.AdamW against torch's AdamW (foreach, the default, and fused=True) on the parameters of
issue 31's models (the shapes of benchmarks/peers.py's configurations; float32 parameters and gradients, as
under autocast): GPU time per step (CUDA events; the kernels alone, the host's work hidden as in a GPU-bound
training step), bandwidth (28 bytes per parameter), host time per step (the call, without waiting), GPU time
from an idle GPU (host and kernels in series, as in a host-bound loop), and the largest difference from fused=True after 3 steps on the same inputs.

    python benchmarks/adamw.py --out $OUT                         # ~1 min on an H200
    python benchmarks/adamw.py --models gpt2 --sweep --out $OUT   # BLOCK and num_warps of the kernel
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from peers import MODELS

SLEEP_CYCLES = 40_000_000  # ~20 ms at the H200's clock: longer than any step's host work
BYTES_PER_PARAM = 28  # float32: parameter, gradient, exp_avg, exp_avg_sq read; parameter and moments written


def shapes_of(model_name: str) -> list[tuple[int, ...]]:
    """The parameter shapes of one of peers.py's models (built on the meta device: nothing allocated)."""
    import transformers

    spec = MODELS[model_name]
    config_cls, model_cls = (getattr(transformers, name) for name in spec["classes"])
    with torch.device("meta"):
        model = model_cls(config_cls(**spec["config"]))
    return [tuple(p.shape) for p in model.parameters()]


def make_params(shapes, seed=0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.randn(s, device="cuda", generator=g).requires_grad_()
        p.grad = torch.randn(s, device="cuda", generator=g) * 1e-3
        params.append(p)
    return params


def time_steps(opt, steps: int = 20, warmup: int = 3) -> dict:
    """GPU ms of the step's kernels alone (the host's work queued behind a GPU sleep, as in a training step
    whose GPU runs behind its host), GPU ms with the host in the way (from an idle GPU: a host-bound loop's
    cost), and the host's ms in the call."""
    gpu, serial, host = [], [], []
    for i in range(warmup + steps):
        for hidden in (True, False):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if hidden:
                torch.cuda._sleep(SLEEP_CYCLES)  # the GPU reaches `start` after the host has queued the step
            start.record()
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                (gpu if hidden else serial).append(start.elapsed_time(end))
                if not hidden:
                    host.append((t1 - t0) * 1e3)
    return {
        "gpu_ms": statistics.median(gpu),
        "serial_ms": statistics.median(serial),
        "host_ms": statistics.median(host),
    }


def parity(shapes, make_opt) -> float:
    """Largest |difference| of the parameters from fused=True's after 3 steps from the same values."""
    ours, ref = make_params(shapes, seed=1), make_params(shapes, seed=1)
    a, b = make_opt(ours), torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(3):
        a.step()
        b.step()
    return max((p - q).abs().max().item() for p, q in zip(ours, ref, strict=True))


def run_model(name: str, sweep: bool) -> dict:
    from opadvisor.kernels import adamw

    shapes = shapes_of(name)
    n = sum(torch.Size(s).numel() for s in shapes)
    params = make_params(shapes)
    rows = {}

    def measure(label, make):
        opt = make(params)
        r = time_steps(opt)
        r["tb_per_s"] = BYTES_PER_PARAM * n / (r["gpu_ms"] * 1e-3) / 1e12
        rows[label] = r
        print(f"{name:8s} {label:28s} gpu {r['gpu_ms']:7.3f} ms  {r['tb_per_s']:.2f} TB/s  "
              f"host {r['host_ms']:6.3f} ms  gpu from idle {r['serial_ms']:7.3f} ms", flush=True)  # fmt: skip
        del opt  # its state freed before the next optimizer's
        torch.cuda.empty_cache()

    measure("torch foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1))
    measure("torch fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True))
    configs = [(adamw.BLOCK, adamw.NUM_WARPS)]
    if sweep:
        configs = [(b, w) for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16) if b // (32 * w) >= 4]
    default = (adamw.BLOCK, adamw.NUM_WARPS)
    for block, warps in configs:
        adamw.BLOCK, adamw.NUM_WARPS = block, warps
        measure(
            f"opadvisor BLOCK {block} warps {warps}", lambda ps: adamw.AdamW(ps, lr=1e-3, weight_decay=0.1)
        )
    adamw.BLOCK, adamw.NUM_WARPS = default
    params.clear()  # freed (measure reads this list) before the parity's two copies
    torch.cuda.empty_cache()
    small = shapes[:12]  # parity on the first tensors: the arithmetic compared, in seconds at any size
    diff = parity(small, lambda ps: adamw.AdamW(ps, lr=1e-3, weight_decay=0.1))
    print(
        f"{name:8s} max |opadvisor - fused| after 3 steps (first {len(small)} tensors): {diff:.3g}",
        flush=True,
    )
    return {"params": n, "tensors": len(shapes), "rows": rows, "parity_max_abs": diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "deberta", "bert", "llama"])
    parser.add_argument("--sweep", action="store_true", help="time several BLOCK / num_warps of the kernel")
    parser.add_argument("--out", default="adamw-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.models:
        results[name] = run_model(name, args.sweep)
        (out / "adamw.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

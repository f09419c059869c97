#!/usr/bin/env python3
"""Benchmark opadvisor's kernels on a GPU: eager PyTorch vs torch.compile vs opadvisor.kernels.

    python3 benchmarks/kernels.py [--out DIR] [--variants] [--small] [--quick] [--host-only]

Per op and shape, forward and forward+backward: median times (triton.testing.do_bench), the bytes the op
must move at least (inputs read once, outputs written once) over the time as GB/s, that as a percentage of
the device's measured copy bandwidth (a large device-to-device copy, bytes read + written), and the
speedups. The tables time the kernels at every shape; the `dispatch` column says what the op runs there by
default (`kernel`, or `chain` under its size threshold: then the eager column is what it costs). Prints the
table and writes DIR/kernels.md (markdown) and DIR/kernels.json.

`--small` times fwd+bwd and fwd from Python, kernels forced, against the eager chains over a range of sizes:
the measurement behind each op's size threshold (SMALL_NUMEL, SMALL_CLASSES). `--variants` also times the
launch alternatives the kernels choose between (RNG layout, mask storage, tile sizes, the single-program vs
looped softmax) so those choices rest on measurements. `--host-only` (or `--profile-host` after the tables):
where the host time of a call goes.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP_MS, REP_MS = 10, 60


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def bench_graph(fn) -> float:
    """GPU time alone: `fn` captured in a CUDA graph and replayed (no launch or Python overhead).

    Dropout seeds drawn during capture would be frozen into the graph anyway; opadvisor's is fixed here.
    """
    from opadvisor.kernels import fixed_dropout_seed
    from triton.testing import do_bench_cudagraph

    with fixed_dropout_seed((1, 2, 3)):
        try:
            return do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")
        except Exception as exc:  # a chain that cannot be captured: report, keep going
            print(f"graph capture failed: {exc!r}", flush=True)
            return float("nan")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read + written."""
    n = 2**30
    src = torch.empty(n, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * 2 * n / ms / 1e6


def _fwd_bwd(f, args, needs, dy):
    return torch.autograd.grad(f(*args), needs, dy)


def time_fwd(f, *args) -> float:
    with torch.no_grad():
        return bench(functools.partial(f, *args))


def time_fwd_bwd(f, args, needs, dy) -> float:
    return bench(functools.partial(_fwd_bwd, f, args, needs, dy))


# ---------------------------------------------------------------------------------------------------
# The chains being replaced, as a user writes them
# ---------------------------------------------------------------------------------------------------


def deberta_chain(x, mask):
    fill = torch.finfo(x.dtype).min
    return torch.softmax(x.masked_fill(mask, fill), -1).masked_fill(mask, 0.0)


def causal_chain(x, mask):
    return torch.softmax(x.masked_fill(mask, float("-inf")), -1)


def bert_chain(x, mask, scale=0.125, p=0.1):
    return F.dropout(torch.softmax(x * scale + mask, -1), p)


def bda_chain(x, bias, residual, p=0.1):
    return residual + F.dropout(x + bias, p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"), help="folder for kernels.md/json")
    ap.add_argument("--variants", action="store_true", help="also time the launch alternatives")
    ap.add_argument("--small", action="store_true", help="also time small sizes (the size thresholds)")
    ap.add_argument("--no-tables", action="store_true", help="skip the main tables (with --small etc.)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a smoke test)")
    ap.add_argument("--profile-host", action="store_true", help="where the host time of a call goes")
    ap.add_argument("--host-only", action="store_true", help="only the host-time profile (no tables)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2

    import triton
    from opadvisor.kernels import PaddedLinear, bias_dropout_add, dropout_add, masked_softmax, softmax

    torch.manual_seed(0)
    thresholds = default_thresholds()
    dev = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    env = {
        "device": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "copy_GBps": round(copy_gbs, 1),
        "command": "python3 " + " ".join(sys.argv),
    }
    env["thresholds"] = thresholds
    print(json.dumps(env))
    if args.host_only:
        profile_host(thresholds)
        return 0
    force_kernels()  # the tables time the kernels at every size; `dispatch` says what runs by default
    rows: list[dict] = []
    lin_rows: list[dict] = []
    if not args.no_tables:
        rows, lin_rows = run_tables(
            args, copy_gbs, thresholds, masked_softmax, bias_dropout_add, PaddedLinear
        )
    variants: list[dict] = []
    if args.variants:
        variants = run_variants(copy_gbs, softmax, dropout_add, masked_softmax, bias_dropout_add)
    if args.small or args.variants:
        variants += run_small()
    write_reports(args.out, env, rows, lin_rows, variants)
    restore_thresholds(thresholds)
    if args.profile_host:
        try:
            profile_host(thresholds)
        except Exception:  # diagnostics only: the tables are written already
            traceback.print_exc()
    return 0


def default_thresholds() -> dict[str, int]:
    """The size thresholds the ops ship with (the tables force the kernels; these say what runs)."""
    from opadvisor.kernels import dropout_add, softmax

    ce = importlib.import_module("opadvisor.kernels.cross_entropy")  # the package's name is the function
    return {
        "softmax.SMALL_NUMEL": softmax.SMALL_NUMEL,
        "dropout_add.SMALL_NUMEL": dropout_add.SMALL_NUMEL,
        "cross_entropy.SMALL_CLASSES": ce.SMALL_CLASSES,
    }


def force_kernels() -> None:
    from opadvisor.kernels import dropout_add, softmax

    softmax.SMALL_NUMEL = dropout_add.SMALL_NUMEL = 0
    importlib.import_module("opadvisor.kernels.cross_entropy").SMALL_CLASSES = 0


def restore_thresholds(thresholds: dict[str, int]) -> None:
    from opadvisor.kernels import dropout_add, softmax

    softmax.SMALL_NUMEL = thresholds["softmax.SMALL_NUMEL"]
    dropout_add.SMALL_NUMEL = thresholds["dropout_add.SMALL_NUMEL"]
    importlib.import_module("opadvisor.kernels.cross_entropy").SMALL_CLASSES = thresholds[
        "cross_entropy.SMALL_CLASSES"
    ]


def dispatched(op: str, numel: int, thresholds: dict[str, int], classes: int = 0) -> str:
    """What `op` runs by default on CUDA at this size: "kernel" or "chain" (its size threshold)."""
    if op == "cross_entropy":
        return "kernel" if classes >= thresholds["cross_entropy.SMALL_CLASSES"] else "chain"
    key = "softmax.SMALL_NUMEL" if op == "masked_softmax" else "dropout_add.SMALL_NUMEL"
    return "kernel" if numel >= thresholds[key] else "chain"


def run_tables(args, copy_gbs, thresholds, masked_softmax, bias_dropout_add, PaddedLinear):
    """The main tables: per op and shape, fwd and fwd+bwd (rows), and the LM-head modules (lin_rows)."""
    from opadvisor.kernels import cross_entropy

    bf16 = torch.bfloat16
    rows: list[dict] = []

    def record(op, shape, mode, nbytes, e2e, graph, path):
        """e2e: (eager, compile, ours) ms by do_bench; graph: the same replayed from a CUDA graph."""
        eager, compiled, ours = e2e
        g_eager, g_compiled, g_ours = graph
        row = {
            "op": op,
            "shape": shape,
            "mode": mode,
            "dispatch": path,
            "bytes": nbytes,
            "floor_ms": nbytes / copy_gbs / 1e6,
            "eager_ms": eager,
            "compile_ms": compiled,
            "ours_ms": ours,
            "ours_GBps": nbytes / ours / 1e6,
            "pct_copy": 100 * nbytes / ours / 1e6 / copy_gbs,
            "vs_eager": eager / ours,
            "vs_compile": compiled / ours,
            "graph_eager_ms": g_eager,
            "graph_compile_ms": g_compiled,
            "graph_ours_ms": g_ours,
            "graph_ours_GBps": nbytes / g_ours / 1e6,
            "graph_pct_copy": 100 * nbytes / g_ours / 1e6 / copy_gbs,
            "graph_vs_eager": g_eager / g_ours,
            "graph_vs_compile": g_compiled / g_ours,
        }
        rows.append(row)
        print(
            f"{op:16s} {shape:40s} {mode:7s} [{path}] | do_bench: eager {eager:.3f} compile {compiled:.3f} "
            f"ours {ours:.3f} ms "
            f"({row['pct_copy']:.0f}% copy, x{row['vs_eager']:.2f} eager, x{row['vs_compile']:.2f} compile) "
            f"| graph: eager {g_eager:.3f} compile {g_compiled:.3f} ours {g_ours:.3f} ms "
            f"({row['graph_pct_copy']:.0f}% copy, x{row['graph_vs_eager']:.2f}, x{row['graph_vs_compile']:.2f})",
            flush=True,
        )

    def compare(op, shape_s, chain, ours_fn, make_inputs, fwd_bytes, bwd_bytes, path, autocast=False):
        """Time chain (eager), torch.compile(chain) and ours_fn, forward and forward+backward."""
        compiled = torch.compile(chain)
        with torch.autocast("cuda", dtype=bf16, enabled=autocast):
            inputs = make_inputs(False)
            fns = [functools.partial(f, *inputs) for f in (chain, compiled, ours_fn)]
            e2e, graph = [bench(f) for f in fns], [bench_graph(f) for f in fns]
            record(op, shape_s, "fwd", fwd_bytes, e2e, graph, path)
            inputs = make_inputs(True)
            needs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            dy = torch.randn_like(chain(*inputs))
            fns = [functools.partial(_fwd_bwd, f, inputs, needs, dy) for f in (chain, compiled, ours_fn)]
            e2e, graph = [bench(f) for f in fns], [bench_graph(f) for f in fns]
            record(op, shape_s, "fwd+bwd", fwd_bytes + bwd_bytes, e2e, graph, path)
        torch.cuda.empty_cache()

    scale_div = 4 if args.quick else 1

    # ---- masked_softmax ------------------------------------------------------------------------
    def sm_inputs(shape, mask_fn):
        def make(grad):
            x = torch.randn(shape, device="cuda", dtype=bf16).requires_grad_(grad)
            return x, mask_fn()

        return make

    B = 32 // scale_div
    shape = (B, 16, 512, 512)
    n = B * 16 * 512 * 512
    mask_bytes = B * 512
    compare(
        "masked_softmax",
        f"{list(shape)} pad mask [B,1,1,512]",
        deberta_chain,
        lambda x, m: masked_softmax(x, m, fill_value=torch.finfo(bf16).min, zero_masked=True),
        sm_inputs(shape, lambda: torch.rand(B, 1, 1, 512, device="cuda") < 0.2),
        2 * 2 * n + mask_bytes,
        3 * 2 * n + mask_bytes,
        dispatched("masked_softmax", n, thresholds),
    )
    B = 8 // scale_div
    shape = (B, 16, 2048, 2048)
    n = B * 16 * 2048 * 2048
    compare(
        "masked_softmax",
        f"{list(shape)} causal [1,1,S,S]",
        causal_chain,
        lambda x, m: masked_softmax(x, m),
        sm_inputs(shape, lambda: torch.ones(2048, 2048, dtype=torch.bool, device="cuda").triu(1)[None, None]),
        2 * 2 * n + 2048 * 2048,
        3 * 2 * n + 2048 * 2048,
        dispatched("masked_softmax", n, thresholds),
    )
    shape = (64, 12, 128, 128)
    n = 64 * 12 * 128 * 128
    compare(
        "masked_softmax",
        f"{list(shape)} add mask, scale, dropout 0.1",
        bert_chain,
        lambda x, m: masked_softmax(x, m, scale=0.125, dropout_p=0.1),
        sm_inputs(
            shape, lambda: torch.where(torch.rand(64, 1, 1, 128, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
        ),
        3 * 2 * n,
        3 * 2 * n,  # fwd: x, y, saved p; bwd: p, dy, dx
        dispatched("masked_softmax", n, thresholds),
    )

    # ---- bias_dropout_add ----------------------------------------------------------------------
    # [16384, 4096] (2^26 elements) is above the dispatch threshold wherever it moves (see --small)
    for rows_, hidden in ((16384, 1024), (8192, 4096), (16384, 4096)):
        rows_ //= scale_div
        n = rows_ * hidden

        def make(grad, rows_=rows_, hidden=hidden):
            x = torch.randn(rows_, hidden, device="cuda", dtype=bf16).requires_grad_(grad)
            b = torch.randn(hidden, device="cuda", dtype=bf16).requires_grad_(grad)
            r = torch.randn(rows_, hidden, device="cuda", dtype=bf16).requires_grad_(grad)
            return x, b, r

        compare(
            "bias_dropout_add",
            f"[{rows_},{hidden}] p=0.1",
            bda_chain,
            lambda x, b, r: bias_dropout_add(x, b, r, 0.1),
            make,
            3 * 2 * n,
            2 * 2 * n,  # fwd: x, residual, y; bwd: dy, dx (dresidual is dy itself)
            dispatched("bias_dropout_add", n, thresholds),
        )

    # ---- cross_entropy (bf16 logits under bf16 autocast, as a training step computes its loss) ---------
    for n_rows, classes, padded in ((4096 // scale_div, 8192, None), (8192 // scale_div, 30522, 30528)):

        def make_ce(grad, n_rows=n_rows, classes=classes, padded=padded):
            full = torch.randn(n_rows, padded or classes, device="cuda", dtype=bf16) * 3
            logits = full[:, :classes].detach().requires_grad_(grad)  # a padded LM head's column slice
            return logits, torch.randint(0, classes, (n_rows,), device="cuda")

        label = f"[{n_rows},{padded}][:, :{classes}]" if padded else f"[{n_rows},{classes}]"
        compare(
            "cross_entropy",
            label,
            F.cross_entropy,
            cross_entropy,
            make_ce,
            2 * n_rows * classes,
            2 * 2 * n_rows * classes,  # fwd: the logits; bwd: the logits read again, the gradient
            dispatched("cross_entropy", n_rows * classes, thresholds, classes),
            autocast=True,
        )

    # ---- PaddedLinear --------------------------------------------------------------------------
    tokens, hidden, vocab = 8192 // scale_div, 768, 30522
    torch.manual_seed(0)
    ref = nn.Linear(hidden, vocab, device="cuda", dtype=bf16)
    lin_rows = []
    x = torch.randn(tokens, hidden, device="cuda", dtype=bf16)
    xg = x.clone().requires_grad_()
    dy = torch.randn(tokens, vocab, device="cuda", dtype=bf16)
    flops = 2 * tokens * hidden * vocab
    for name, mod in [("nn.Linear", ref)] + [
        (f"PaddedLinear(multiple={m})", PaddedLinear(hidden, vocab, device="cuda", dtype=bf16, multiple=m))
        for m in (8, 128)
    ]:
        mod.load_state_dict(ref.state_dict())
        t_f = time_fwd(mod, x)
        t_fb = time_fwd_bwd(mod, (xg,), [xg, *mod.parameters()], dy)
        lin_rows.append(
            {
                "module": name,
                "fwd_ms": t_f,
                "fwd+bwd_ms": t_fb,
                "fwd_TFLOPs": flops / t_f / 1e9,
                "fwd+bwd_TFLOPs": 3 * flops / t_fb / 1e9,
            }
        )
        print(
            f"LM head [{tokens},{hidden}]x[{vocab}] {name:26s} fwd {t_f:.3f} ms  fwd+bwd {t_fb:.3f} ms",
            flush=True,
        )
    torch.cuda.empty_cache()
    return rows, lin_rows


def run_variants(copy_gbs, softmax, dropout_add, masked_softmax, bias_dropout_add) -> list[dict]:
    """Time the alternatives behind the kernels' fixed choices: GPU time from CUDA graphs (so launch
    overhead does not hide the kernels' differences), and do_bench for small tensors (where it is
    launch overhead that decides)."""
    bf16 = torch.bfloat16
    out: list[dict] = []

    def note(group, label, ms, nbytes=None, **extra):
        row = {"group": group, "variant": label, "ms": ms, **extra}
        if nbytes:
            row["GBps"] = nbytes / ms / 1e6
            row["pct_copy"] = 100 * row["GBps"] / copy_gbs
        out.append(row)
        pct = f"  {row['pct_copy']:5.1f}%" if nbytes else ""
        print(f"[variant] {group:34s} {label:44s} {ms:8.4f} ms{pct}", flush=True)

    # bias_dropout_add: RNG layout x mask storage x tile (GPU time)
    saved = (dropout_add.RNG_INTERLEAVE, dropout_add.MASK_MODE, dropout_add.TILE)
    for rows_, hidden in ((16384, 1024), (8192, 4096)):
        n = rows_ * hidden
        x = torch.randn(rows_, hidden, device="cuda", dtype=bf16, requires_grad=True)
        b = torch.randn(hidden, device="cuda", dtype=bf16, requires_grad=True)
        r = torch.randn(rows_, hidden, device="cuda", dtype=bf16, requires_grad=True)
        dy = torch.randn(rows_, hidden, device="cuda", dtype=bf16)
        for inter, mode, tile in [
            (False, "philox", 2048), (True, "philox", 2048), (False, "philox", 4096), (False, "byte", 2048),
        ]:  # fmt: skip
            dropout_add.RNG_INTERLEAVE, dropout_add.MASK_MODE, dropout_add.TILE = inter, mode, tile
            label = f"interleave={inter} mask={mode} tile={tile}"
            with torch.no_grad():
                t_f = bench_graph(functools.partial(bias_dropout_add, x, b, r, 0.1))
            t_fb = bench_graph(functools.partial(_fwd_bwd, bias_dropout_add, (x, b, r, 0.1), [x, b, r], dy))
            note(f"bda fwd [{rows_},{hidden}] (graph)", label, t_f, 3 * 2 * n)
            note(f"bda fwd+bwd [{rows_},{hidden}] (graph)", label, t_fb, 5 * 2 * n)
    dropout_add.RNG_INTERLEAVE, dropout_add.MASK_MODE, dropout_add.TILE = saved

    # masked_softmax launch configs at [32,16,512,512] with the padding mask (GPU time)
    x = torch.randn(32, 16, 512, 512, device="cuda", dtype=bf16, requires_grad=True)
    mask = torch.rand(32, 1, 1, 512, device="cuda") < 0.2
    dy = torch.randn_like(x)
    n = x.numel()
    orig_config = softmax._config
    zm = functools.partial(masked_softmax, zero_masked=True)
    for rows, warps in [(4, 2), (4, 4), (8, 2), (8, 4), (16, 4), (32, 8)]:
        softmax._config = lambda n_cols, mb, lb, rows=rows, warps=warps: (rows, 512, False, warps)
        softmax._plan.cache_clear()
        softmax._launch_plan.cache_clear()
        with torch.no_grad():
            t_f = bench_graph(functools.partial(zm, x, mask))
        t_fb = bench_graph(functools.partial(_fwd_bwd, zm, (x, mask), [x], dy))
        note("softmax [32,16,512,512] fwd (graph)", f"rows={rows} warps={warps}", t_f, 2 * 2 * n)
        note("softmax [32,16,512,512] fwd+bwd (graph)", f"rows={rows} warps={warps}", t_fb, 5 * 2 * n)
    softmax._config = orig_config
    softmax._plan.cache_clear()
    softmax._launch_plan.cache_clear()

    # masked_softmax dropout: the two Philox layouts at [64,12,128,128] (GPU time)
    x = torch.randn(64, 12, 128, 128, device="cuda", dtype=bf16, requires_grad=True)
    mask = torch.where(torch.rand(64, 1, 1, 128, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
    dy = torch.randn_like(x)
    drop = functools.partial(masked_softmax, scale=0.125, dropout_p=0.1)
    saved_inter = softmax.RNG_INTERLEAVE
    for inter in (False, True):
        softmax.RNG_INTERLEAVE = inter
        with torch.no_grad():
            t_f = bench_graph(functools.partial(drop, x, mask))
        t_fb = bench_graph(functools.partial(_fwd_bwd, drop, (x, mask), [x], dy))
        note("softmax dropout [64,12,128,128] fwd (graph)", f"interleave={inter}", t_f, 3 * 2 * x.numel())
        note(
            "softmax dropout [64,12,128,128] fwd+bwd (graph)", f"interleave={inter}", t_fb, 6 * 2 * x.numel()
        )
    softmax.RNG_INTERLEAVE = saved_inter

    # row lengths: GPU time against eager softmax; single-program vs looped rows at 16384
    total = 2**26
    for s_len in (128, 1024, 4096, 16384, 65536):
        x = torch.randn(total // s_len, s_len, device="cuda", dtype=bf16, requires_grad=True)
        dy = torch.randn_like(x)
        t_e = bench_graph(functools.partial(_fwd_bwd, torch.softmax, (x, -1), [x], dy))
        choices = [("default", softmax.MAX_BLOCK)]
        if s_len == 16384:
            choices = [("single", s_len), ("looped", s_len // 2)]
        for label, max_block in choices:
            saved_mb = softmax.MAX_BLOCK
            softmax.MAX_BLOCK = max_block
            t_o = bench_graph(functools.partial(_fwd_bwd, masked_softmax, (x,), [x], dy))
            softmax.MAX_BLOCK = saved_mb
            note(
                f"softmax rows of {s_len} fwd+bwd (graph)", f"{label}; eager {t_e:.3f} ms", t_o, 5 * 2 * total
            )

    return out


def run_small() -> list[dict]:
    """Sizes around each op's threshold, from Python (do_bench: launch and Python included), kernels
    forced: fwd+bwd and fwd of the kernel path against the eager chain. An op's threshold is the size
    from which its kernel is no slower than the chain (fwd+bwd, the training case)."""
    from opadvisor.kernels import bias_dropout_add, cross_entropy, masked_softmax

    bf16 = torch.bfloat16
    out: list[dict] = []

    def note(group, numel, t_e, t_o):
        out.append({"group": group, "variant": f"numel={numel}", "ms": t_o, "eager_ms": t_e})
        print(f"[small] {group:44s} numel={numel:>10d} eager {t_e:.4f} ms ours {t_o:.4f} ms "
              f"({t_e / t_o:.2f}x)", flush=True)  # fmt: skip

    def both(group, numel, chain, ours, inputs, needs):
        dy = torch.randn_like(chain(*inputs))
        note(
            f"{group} fwd+bwd",
            numel,
            time_fwd_bwd(chain, inputs, needs, dy),
            time_fwd_bwd(ours, inputs, needs, dy),
        )
        detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in inputs]
        note(f"{group} fwd", numel, time_fwd(chain, *detached), time_fwd(ours, *detached))

    for log2 in (16, 18, 20, 21, 22, 23, 24, 25, 26):
        numel = 2**log2
        # attention probabilities [B, 12, 128, 128] with a BERT additive mask, scale and dropout
        batch = max(1, numel // (12 * 128 * 128))
        x = torch.randn(batch, 12, 128, 128, device="cuda", dtype=bf16, requires_grad=True)
        m = torch.where(torch.rand(batch, 1, 1, 128, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
        sm = functools.partial(masked_softmax, scale=0.125, dropout_p=0.1)
        both("masked_softmax [B,12,128,128] add, drop", x.numel(), bert_chain, sm, (x, m), [x])
        # residual stream [tokens, 768] (BERT-base), bias, dropout 0.1
        tokens = max(1, numel // 768)
        x = torch.randn(tokens, 768, device="cuda", dtype=bf16, requires_grad=True)
        b = torch.randn(768, device="cuda", dtype=bf16, requires_grad=True)
        r = torch.randn_like(x, requires_grad=True)
        bda = functools.partial(bias_dropout_add, p=0.1)
        both("bias_dropout_add [T,768] p=0.1", x.numel(), bda_chain, bda, (x, b, r), [x, b, r])
        torch.cuda.empty_cache()
    for classes in (2048, 4096, 8192, 16384, 32768):
        n_rows = 4096
        x = torch.randn(n_rows, classes, device="cuda", dtype=bf16, requires_grad=True)
        t = torch.randint(0, classes, (n_rows,), device="cuda")
        with torch.autocast("cuda", dtype=bf16):
            both(
                f"cross_entropy [4096,C] C={classes}", x.numel(), F.cross_entropy, cross_entropy, (x, t), [x]
            )
    return out


def profile_host(thresholds: dict[str, int]) -> None:
    """Where the host time of a call goes: per op, host time per fwd+bwd call (the GPU queue not drained)
    of the kernel path (kernels forced) and the eager chain, with the autograd engine's device thread (as
    `torch.autograd.grad` runs a CUDA backward) and without it (set_multithreading_enabled(False): the
    backward on the calling thread); then cProfile of the kernel path and the torch profiler's CPU view."""
    import cProfile
    import pstats

    from opadvisor.kernels import bias_dropout_add, cross_entropy, masked_softmax

    force_kernels()
    # Small tensors: a call's host time does not depend on the size, and here the GPU (a few microseconds
    # a kernel) never holds the host back, so the times below are host time alone.
    bf16 = torch.bfloat16
    x = torch.randn(256, 1024, device="cuda", dtype=bf16, requires_grad=True)
    b = torch.randn(1024, device="cuda", dtype=bf16, requires_grad=True)
    r = torch.randn(256, 1024, device="cuda", dtype=bf16, requires_grad=True)
    dy = torch.randn_like(x)
    s = torch.randn(1, 12, 128, 128, device="cuda", dtype=bf16, requires_grad=True)
    m = torch.where(torch.rand(1, 1, 1, 128, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
    ds = torch.randn_like(s)
    lg = torch.randn(256, 8192, device="cuda", dtype=bf16, requires_grad=True)
    tg = torch.randint(0, 8192, (256,), device="cuda")
    sm = functools.partial(masked_softmax, scale=0.125, dropout_p=0.1)

    def ce_grad(f):
        with torch.autocast("cuda", dtype=bf16):
            return torch.autograd.grad(f(lg, tg), [lg])

    bda = functools.partial(_fwd_bwd, bias_dropout_add, (x, b, r, 0.1), [x, b, r], dy)
    softmax = functools.partial(_fwd_bwd, sm, (s, m), [s], ds)
    cases = [
        ("empty autograd.Function", functools.partial(_fwd_bwd, _Nothing.apply, (x,), [x], dy)),
        ("bias_dropout_add fwd+bwd", bda),
        ("  its chain", functools.partial(_fwd_bwd, bda_chain, (x, b, r), [x, b, r], dy)),
        (
            "bias_dropout_add fwd",
            functools.partial(bias_dropout_add, x.detach(), b.detach(), r.detach(), 0.1),
        ),
        ("  its chain", functools.partial(bda_chain, x.detach(), b.detach(), r.detach())),
        ("masked_softmax fwd+bwd", softmax),
        ("  its chain", functools.partial(_fwd_bwd, bert_chain, (s, m), [s], ds)),
        ("cross_entropy fwd+bwd", functools.partial(ce_grad, cross_entropy)),
        ("  its chain", functools.partial(ce_grad, F.cross_entropy)),
    ]
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for label, fn in cases:
            print(
                f"[host] autograd threads {threads!s:5s} {label:28s} {host_us(fn):7.1f} us per call",
                flush=True,
            )
    torch.autograd.set_multithreading_enabled(True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        bda()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    # cProfile sees only this thread; the backward runs on the autograd engine's device thread. The torch
    # profiler's CPU view covers both: host time per call of each op / autograd node.
    for label, fn in [("bias_dropout_add fwd+bwd", bda), ("masked_softmax fwd+bwd", softmax)]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
        print(f"[host] {label}: CPU time per call by op (torch.profiler, 100 calls)", flush=True)
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    restore_thresholds(thresholds)


class _Nothing(torch.autograd.Function):
    """The floor of a Python autograd.Function's host cost: one allocation forward, none backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def host_us(fn, calls: int = 300) -> float:
    """Microseconds of host time per call of `fn`, back to back, the GPU queue not drained (median of 3)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(runs)[1]


def write_reports(out_dir, env, rows, lin_rows, variants) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernels.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "linear": lin_rows, "variants": variants}, f, indent=1)
    lines = [
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; "
        f"measured copy bandwidth {env['copy_GBps']:.0f} GB/s (read + write). Command: `{env['command']}`. "
        f"Size thresholds: {env['thresholds']}.",
        "",
        "Times in ms, median. *do_bench*: back-to-back calls from Python (triton.testing.do_bench), launch and "
        "Python overhead included. *graph*: the same calls replayed from a CUDA graph "
        "(triton.testing.do_bench_cudagraph), GPU time alone. GB/s and % of copy count the bytes the op must move "
        "at least (each input read once, each output written once) over opadvisor's time. The kernels run at "
        "every shape here; *dispatch* says what the op runs there by default (*chain*: under its size "
        "threshold, the eager chain).",
        "",
        "| op | shape | pass | dispatch | floor | eager | compile | opadvisor | GB/s | % copy | vs eager | "
        "vs compile | graph: eager | compile | opadvisor | % copy | vs eager | vs compile |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['mode']} | {r['dispatch']} | {r['floor_ms']:.3f} | {r['eager_ms']:.3f} | "
            f"{r['compile_ms']:.3f} | {r['ours_ms']:.3f} | {r['ours_GBps']:.0f} | {r['pct_copy']:.0f}% | "
            f"{r['vs_eager']:.2f}x | {r['vs_compile']:.2f}x | {r['graph_eager_ms']:.3f} | "
            f"{r['graph_compile_ms']:.3f} | {r['graph_ours_ms']:.3f} | {r['graph_pct_copy']:.0f}% | "
            f"{r['graph_vs_eager']:.2f}x | {r['graph_vs_compile']:.2f}x |"
        )
    lines += [
        "",
        "| LM head module | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in lin_rows:
        lines.append(
            f"| {r['module']} | {r['fwd_ms']:.3f} | {r['fwd+bwd_ms']:.3f} | {r['fwd_TFLOPs']:.0f} | {r['fwd+bwd_TFLOPs']:.0f} |"
        )
    if variants:
        lines += ["", "| variant group | variant | ms | % of copy |", "|---|---|---:|---:|"]
        for v in variants:
            pct = f"{v['pct_copy']:.0f}%" if "pct_copy" in v else ""
            lines.append(f"| {v['group']} | {v['variant']} | {v['ms']:.4f} | {pct} |")
    with open(os.path.join(out_dir, "kernels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)

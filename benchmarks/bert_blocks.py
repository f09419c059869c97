"""BERT-base (eager attention config) training step: the safe fixes with and without compile_blocks, in one process.

    python benchmarks/bert_blocks.py                 # ~3-5 min on an H100/H200 (two block compiles)
    python benchmarks/bert_blocks.py --compile       # + the whole model under torch.compile (~1-2 min more)
    python benchmarks/bert_blocks.py --device cpu --tiny --steps 3 --rounds 1   # smoke test, no GPU

Variants (each its own model, same seed and batch; bf16 autocast, `model(**batch)`, seq 512, batch 16):

- original:         `BertForMaskedLM(BertConfig(attn_implementation="eager"))`, AdamW (what the user wrote);
- safe:             what `opadvisor apply --rule all` wrote before compile_blocks existed:
                    `model.set_attn_implementation("sdpa")`, `AdamW(..., fused=True)`,
                    `opadvisor.patch(model, rules=["fused_cross_entropy", "fused_dropout_add", "gemm_align"])`;
- safe + blocks:    the same with "compile_blocks" in the rules: each BertLayer runs one compiled forward
                    shared by the 12 instances (the output-block patches are then left inside them);
- torch.compile:    (--compile) the original model under torch.compile, for reference.

Timing: the variants take turns (--rounds rounds of --steps steps each, after --warmup steps that include
the compiles), CUDA synchronised at every step end; the median step and p25-p75 per variant, and the host
time per step (until the step's work is issued, before the synchronisation: when it is close to the step,
the step is host-bound). The number of graphs dynamo compiled for the blocks is reported (1 per dropout
setting and mode expected: 2 with the first-call check, never one per layer). Writes
$OUT/bert_blocks.md and .json (or --out-dir) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import opadvisor

SAFE_RULES = ["fused_cross_entropy", "fused_dropout_add", "gemm_align"]


def build(variant: str, opts):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    kwargs = {"attn_implementation": "eager"}
    if opts.tiny:
        kwargs |= {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
        }
    config = BertConfig(**kwargs)
    model = BertForMaskedLM(config)
    fused = variant != "original" and variant != "torch.compile" and opts.device == "cuda"
    if variant.startswith("safe"):
        model.set_attn_implementation("sdpa")
        rules = SAFE_RULES + (["compile_blocks"] if variant == "safe + blocks" else [])
        model = opadvisor.patch(model, rules=rules, quiet=True)
    model = model.to(opts.device)
    model.train()
    if variant == "torch.compile":
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    return model, optimizer, config


def step(model, optimizer, batch, device: str) -> tuple[float, float]:
    """(host seconds until the step's work is issued, wall seconds to its end)."""
    t0 = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    issued = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
    return issued - t0, time.perf_counter() - t0


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0] * 1e3, statistics.median(xs) * 1e3, q[2] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at sequence 64 (smoke test)")
    parser.add_argument(
        "--compile", action="store_true", help="also time the whole model under torch.compile"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per variant first (compiles)")
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".")))
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (--device cpu --tiny: smoke test)", file=sys.stderr)
        return 2
    from opadvisor.patching import compile_blocks as patch_module

    graphs: list[int] = []

    def counted(gm, example_inputs):  # inductor, counting the graphs dynamo hands it
        from torch._inductor.compile_fx import compile_fx

        graphs.append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs)

    patch_module.BLOCK_COMPILE_OPTIONS["backend"] = counted
    variants = ["original", "safe", "safe + blocks"] + (["torch.compile"] if opts.compile else [])
    batch_size, seq = (2, 64) if opts.tiny else (16, 512)
    runs = {}
    for v in variants:
        model, optimizer, config = build(v, opts)
        ids = torch.randint(0, config.vocab_size, (batch_size, seq), device=opts.device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        t0 = time.perf_counter()
        for _ in range(opts.warmup):
            step(model, optimizer, batch, opts.device)
        print(f"[{v}] warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        runs[v] = {"model": model, "opt": optimizer, "batch": batch, "host": [], "wall": []}
    for _ in range(opts.rounds):
        for v in variants:
            r = runs[v]
            for _ in range(opts.steps):
                host, wall = step(r["model"], r["opt"], r["batch"], opts.device)
                r["host"].append(host)
                r["wall"].append(wall)
    report = patch_module.patch_report(runs["safe + blocks"]["model"])
    device = torch.cuda.get_device_name(0) if opts.device == "cuda" else "cpu"
    base = statistics.median(runs["original"]["wall"])
    lines = [
        f"## BERT-base (eager config) step: safe fixes with and without compile_blocks ({device})",
        "",
        f"- torch {torch.__version__}; `python benchmarks/bert_blocks.py {' '.join(sys.argv[1:])}`",
        f"- {opts.rounds} rounds x {opts.steps} steps per variant, taking turns, after {opts.warmup} warm-up steps",
        f"- graphs compiled for the blocks: {len(graphs)} (one per dropout setting / mode, shared by all layers)",
        f"- compile_blocks' report: {'; '.join(report.lines()) if report else 'none'}",
        "",
        "| variant | median step ms | p25 - p75 ms | host ms (median) | vs original |",
        "|---|---:|---:|---:|---:|",
    ]
    result = {"device": device, "graphs": len(graphs), "variants": {}}
    for v in variants:
        p25, med, p75 = quantiles(runs[v]["wall"])
        host = statistics.median(runs[v]["host"]) * 1e3
        lines.append(f"| {v} | {med:.2f} | {p25:.2f} - {p75:.2f} | {host:.2f} | {base * 1e3 / med:.2f}x |")
        result["variants"][v] = {"median_ms": med, "p25_ms": p25, "p75_ms": p75, "host_ms": host}
    text = "\n".join(lines) + "\n"
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / "bert_blocks.md").write_text(text)
    (opts.out_dir / "bert_blocks.json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`linear_cross_entropy`'s chunking on the GPU: equal chunks against the largest chunk then a remainder, at
several MAX_CHUNK_BYTES, on the LM heads of issue 31's models (forward with the gradients, then the
backward's scaling; bf16 autocast, float32 master weights as in training).

    python benchmarks/lce_chunks.py --out $OUT      # ~1 min on an H200
    python benchmarks/lce_chunks.py --heads llama --limits-mib 1024 2048 --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path

import torch

HEADS = {  # name: (tokens, hidden, vocabulary, bias)
    "gpt2": (8192, 768, 50257, False),
    "llama": (8192, 2048, 128256, False),
    "deberta": (4096, 768, 128100, True),
    "bert": (8192, 768, 30522, True),
}
LIMITS = (256 << 20, 512 << 20, 1 << 30)


def largest_then_rest(n_rows: int, vocab: int, dtype: torch.dtype, lce) -> int:
    """The chunking before equal chunks: as many rows as fit, the remainder last."""
    return max(1, min(n_rows, lce.MAX_CHUNK_BYTES // max(1, vocab * dtype.itemsize)))


def time_head(lce, tokens, hidden, vocab, has_bias, steps=10) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).requires_grad_()
    b = (torch.zeros(vocab, device="cuda")).requires_grad_() if has_bias else None
    t = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    times = []
    for i in range(steps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lce.linear_cross_entropy(h, w, t, bias=b)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        h.grad = w.grad = None
        if b is not None:
            b.grad = None
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="lce-out")
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    parser.add_argument("--limits-mib", nargs="+", type=int, default=[limit >> 20 for limit in LIMITS],
                        help="MAX_CHUNK_BYTES values to time, in MiB")  # fmt: skip
    args = parser.parse_args()
    lce = importlib.import_module("opadvisor.kernels.linear_cross_entropy")
    equal = lce.chunk_rows
    rows = []
    for name in args.heads:
        tokens, hidden, vocab, has_bias = HEADS[name]
        for limit in (mib << 20 for mib in args.limits_mib):
            lce.MAX_CHUNK_BYTES = limit
            for label, rule in (
                ("equal", equal),
                ("largest", lambda n, v, d: largest_then_rest(n, v, d, lce)),
            ):
                lce.chunk_rows = rule
                chunk = rule(tokens, lce._padded_size(vocab), torch.bfloat16)
                ms = time_head(lce, tokens, hidden, vocab, has_bias)
                rows.append({"head": name, "limit_mib": limit >> 20, "chunking": label, "chunk_rows": chunk,
                             "ms": ms})  # fmt: skip
                print(f"{name:8s} {limit >> 20:5d} MiB {label:8s} rows {chunk:5d}  {ms:7.3f} ms", flush=True)
            lce.chunk_rows = equal
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (out / "lce_chunks.json").write_text(
        json.dumps({"device": device, "torch": torch.__version__, "rows": rows})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

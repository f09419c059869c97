"""The BERT example's step phase by phase, each timed with a CUDA synchronisation before and after.

    cd FOLDER_WITH_bert_train.py && python /path/to/benchmarks/bert_phases.py [--graphs] [--nosync]

Imports `bert_train` from the current folder (the example, or a copy `opadvisor apply` rewrote), builds it at
BERT-base size (hidden 768, 12 layers, seq 512, batch 16, bf16 autocast, fused AdamW) and prints the median
ms of data, host-to-device copy, forward, loss, backward, optimizer and `.item()`. With `--graphs` the model
is wrapped in `opadvisor.kernels.cuda_graphed`, so forward and backward launch nothing from the host and their
synchronised times are GPU time. `--nosync` times the phases without the inner synchronisations (host time).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.getcwd())
import bert_train as bt  # noqa: E402
from opadvisor.kernels import cuda_graphed  # noqa: E402

PHASES = ("data", "h2d", "fwd", "loss", "bwd", "opt", "item")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", action="store_true", help="wrap the model in cuda_graphed")
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--nosync", action="store_true", help="no synchronisation between phases")
    o = ap.parse_args()
    args = argparse.Namespace(hidden=768, layers=12, heads=12, seq=512, batch=16, vocab=o.vocab, dropout=0.1)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = bt.BertForMaskedLM(args.vocab, args.hidden, args.layers, args.heads, args.seq, args.dropout)
    model = model.to(dev)
    if o.graphs:
        model = cuda_graphed(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(bt.make_dataset(args, 1000, 1000, gen), batch_size=16, shuffle=True, generator=gen)
    times: dict[str, list[float]] = {k: [] for k in (*PHASES, "total")}

    def mark(marks: list[float]) -> None:
        if not o.nosync:
            torch.cuda.synchronize()
        marks.append(time.perf_counter())

    step = 0
    for _epoch in range(4):
        for fetch_start, (input_ids, lengths, labels) in _batches(loader):
            marks = [fetch_start]
            mark(marks)
            input_ids, lengths, labels = input_ids.to(dev), lengths.to(dev), labels.to(dev)
            mark(marks)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids, lengths)
                mark(marks)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
            mark(marks)
            opt.zero_grad()
            loss.backward()
            mark(marks)
            opt.step()
            mark(marks)
            loss.item()
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
            step += 1
            if step > 8:  # warm-up excluded
                for name, a, b in zip(PHASES, marks, marks[1:], strict=False):
                    times[name].append((b - a) * 1000)
                times["total"].append((marks[-1] - marks[0]) * 1000)
    label = f"{'graphs' if o.graphs else 'eager'} vocab {o.vocab} nosync={o.nosync}"
    print(label + ": " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in times.items()), flush=True)


def _batches(loader):
    """(time before fetching, batch) for each batch: fetching counts in the step's "data" phase."""
    it = iter(loader)
    while True:
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield start, next(it)
        except StopIteration:
            return


if __name__ == "__main__":
    main()

"""Which safe fix adds host time to the default-attention BERT step (bf16, batch 16, seq 512; issue 17, ninth
session): each patch alone on top of fused AdamW, then all; median step (CUDA synchronised) and the host time
to enqueue it. Writes $OUT/sdpa_ablation.md.

    python benchmarks/bert_sdpa_host.py
"""

import os
import statistics
import time
import warnings

import torch
from transformers import BertConfig, BertForMaskedLM

import opadvisor

warnings.filterwarnings("ignore")
dev = "cuda"
ids = torch.randint(0, 30522, (16, 512), device=dev)
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
VARIANTS = [
    ("original", None, False),
    ("fused AdamW", [], True),
    ("+ hf_mlm_loss", ["hf_mlm_loss"], True),
    ("+ padded_linear", ["padded_linear"], True),
    ("+ hf_bert_output", ["hf_bert_output"], True),
    ("+ compile_blocks", ["compile_blocks"], True),
    ("all safe", ["compile_blocks", "hf_mlm_loss", "hf_bert_output", "padded_linear"], True),
]


def step(model, opt):
    t0 = time.perf_counter()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host * 1000, (time.perf_counter() - t0) * 1000


rows = []
for name, rules, fused in VARIANTS:
    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig()).to(dev)
    if rules:
        m = opadvisor.patch(m, rules=rules, quiet=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused)
    for _ in range(6):
        step(m, opt)
    hs, ws = zip(*[step(m, opt) for _ in range(20)], strict=True)
    rows.append(f"| {name} | {statistics.median(ws):.2f} | {statistics.median(hs):.2f} |")
    print(rows[-1], flush=True)
    del m, opt
    torch.cuda.empty_cache()
out = "| variant | step ms (synced) | host ms to enqueue |\n|---|---:|---:|\n" + "\n".join(rows) + "\n"
open(os.path.join(os.environ.get("OUT", "."), "sdpa_ablation.md"), "w").write(out)
print(out)

"""compile_blocks under cuda_graphed (issue 17, ninth session): BERT (SDPA, bf16, batch 16, seq 512) patched
with compile_blocks and the safe patches, trained eagerly and/or under cuda_graphed; prints each phase's median
step and the compiled regions' states, and the full traceback of a compile that fails.

    TORCH_LOGS=recompiles python benchmarks/graphs_compose.py eager,graphed   # phases in one process
    python benchmarks/graphs_compose.py graphed                               # alone (cold or warm cache)
"""

import os
import statistics
import sys
import time
import traceback
import warnings

import torch
from opadvisor.kernels import cuda_graphed
from opadvisor.kernels import region as _region
from transformers import BertConfig, BertForMaskedLM

import opadvisor

_orig_give_up = _region._Region._give_up


def _give_up(self, exc):
    print("=== compile_region failure, full traceback ===", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    _orig_give_up(self, exc)


_region._Region._give_up = _give_up
warnings.simplefilter("always")
dev = "cuda"
ids = torch.randint(0, 30522, (16, 512), device=dev)
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
RULES = ["compile_blocks", "fused_cross_entropy", "fused_dropout_add", "gemm_align"]


def build(graphs):
    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig(attn_implementation=os.environ.get("ATTN", "sdpa"))).to(dev)
    m = opadvisor.patch(m, rules=RULES, quiet=True)
    if graphs:
        m = cuda_graphed(m)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)


def run(model, opt, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1000)
    return ts


for phase in sys.argv[1].split(","):
    t0 = time.perf_counter()
    model, opt = build(phase == "graphed")
    first = run(model, opt, 6)
    ts = run(model, opt, 15)
    states = {}
    for mod in model.modules():
        st = mod.__dict__.get(sys.modules["opadvisor.patching.shared"].STATE)
        if st is not None and getattr(st, "shared", None) is not None:
            states[str(_region.region_state(st.shared.forward))] = (
                states.get(str(_region.region_state(st.shared.forward)), 0) + 1
            )
    print(
        f"RESULT {sys.argv[1]} phase={phase} median={statistics.median(ts):.2f} ms first={[round(x) for x in first]} regions={states} total={time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    del model, opt
    torch.cuda.empty_cache()

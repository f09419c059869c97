"""Why `AdamW(fused=True)` turns T5-small's loss into nan at step 2 on CUDA in bf16 autocast (issue 29's
families table, RESULTS.md), while the for-each AdamW trains: the same model, data and seed, both optimizers
side by side, and where the first non-finite value appears.

    python3 benchmarks/t5_fused_adamw.py --out t5.json     # CUDA

Per optimizer and step: the loss, the gradients that are not finite, and after each step the parameters
that are not finite; after step 1, the parameters whose update differs most between the two optimizers.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch


def _model() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(decoder_start_token_id=0, attn_implementation="eager")  # T5-small
    return T5ForConditionalGeneration(config)


def _bad(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in tensors.items() if t is not None and not torch.isfinite(t).all()]


def _run(model: torch.nn.Module, fused: bool, ids: torch.Tensor, steps: int) -> tuple[list[dict], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    record = []
    after_first: dict[str, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        bad_grads = _bad(grads)
        opt.step()
        params = dict(model.named_parameters())
        record.append(
            {
                "step": step,
                "loss": float(loss),
                "nonfinite_grads": bad_grads[:10],
                "nonfinite_params": _bad({n: p.detach() for n, p in params.items()})[:10],
                "max_abs_grad": max(float(g.abs().max()) for g in grads.values() if g is not None),
            }
        )
        if step == 0:
            after_first = {n: p.detach().clone() for n, p in params.items()}
    state = {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "shared_params": len(list(model.parameters())) != len({id(p) for p in model.parameters()}),
    }
    return record, after_first | {"__state__": state}  # type: ignore[dict-item]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    base = _model().cuda().train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (8, 512), generator=g).cuda()
    runs = {}
    firsts = {}
    for fused in (False, True):
        record, first = _run(copy.deepcopy(base), fused, ids, args.steps)
        runs["fused" if fused else "foreach"] = record
        firsts[fused] = first
    state = firsts[True].pop("__state__")
    firsts[False].pop("__state__")
    diffs = sorted(
        (
            (float((firsts[True][n].float() - firsts[False][n].float()).abs().max()), n)
            for n in firsts[False]
            if n in firsts[True]
        ),
        reverse=True,
    )
    out = {"runs": runs, "state": state, "largest_update_differences_after_step_1": diffs[:10]}
    out["torch"] = torch.__version__
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Why `AdamW(fused=True)` turns T5-small's loss into nan at step 2 on CUDA in bf16 autocast (issue 29's
families table, RESULTS.md), while the for-each AdamW trains: the same model, data and seed, both optimizers
side by side, and where the first non-finite value appears.

    python3 benchmarks/t5_fused_adamw.py --out t5.json     # CUDA

Per optimizer and step: the loss, the gradients that are not finite, and after each step the parameters
that are not finite; after step 1, the parameters whose update differs most between the two optimizers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _model(vendored: bool) -> torch.nn.Module:
    """As the realcode family's train.py builds it: on the CPU after manual_seed(0), then moved; from the
    installed transformers, or (`vendored`) from the family's copy of modeling_t5.py in a user's src/."""
    from transformers import T5Config, T5ForConditionalGeneration

    if vendored:
        import sys
        import tempfile

        from realcode_families import FAMILIES, build_project

        project = Path(tempfile.mkdtemp()) / "t5"
        build_project(FAMILIES["t5"], project)
        sys.path.insert(0, str(project / "src"))
        from hf_t5.modeling_t5 import T5ForConditionalGeneration  # noqa: F811 - the vendored class

    torch.manual_seed(0)
    config = T5Config(decoder_start_token_id=0, attn_implementation="eager")  # T5-small
    return T5ForConditionalGeneration(config).cuda().train()


def _bad(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, t in tensors.items() if t is not None and not torch.isfinite(t).all()]


def _run(model: torch.nn.Module, fused: bool, ids: torch.Tensor, steps: int) -> tuple[list[dict], dict]:
    largest = sorted(((float(p.detach().abs().max()), n) for n, p in model.named_parameters()), reverse=True)
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
        odd = [
            n
            for n, p in model.named_parameters()
            if p.grad is not None and (not p.is_contiguous() or p.grad.stride() != p.stride())
        ]
        opt.step()
        params = dict(model.named_parameters())
        record.append(
            {
                "step": step,
                "loss": float(loss),
                "nonfinite_grads": bad_grads[:10],
                "nonfinite_params": _bad({n: p.detach() for n, p in params.items()})[:10],
                "grads_with_other_strides": odd[:10],
                "max_abs_grad": max(float(g.abs().max()) for g in grads.values() if g is not None),
            }
        )
        if step == 0:
            after_first = {n: p.detach().clone() for n, p in params.items()}
    state = {
        "largest_initial_values": largest[:5],
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "shared_params": len(list(model.parameters())) != len({id(p) for p in model.parameters()}),
    }
    return record, after_first | {"__state__": state}  # type: ignore[dict-item]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--vendored", action="store_true", help="the model from a user's copy of its file")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32128, (8, 512), generator=g).cuda()  # train.py's first batch
    runs = {}
    firsts = {}
    for fused in (False, True):
        record, first = _run(_model(args.vendored), fused, ids, args.steps)
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
    out = {
        "vendored": args.vendored,
        "runs": runs,
        "state": state,
        "largest_update_differences_after_step_1": diffs[:10],
    }
    out["torch"] = torch.__version__
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

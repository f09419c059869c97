"""opadvisor.patch on models whose parameters are held in bfloat16 (`model.to(torch.bfloat16)`, no autocast):
every fix stays installed and training keeps the original's loss within bf16 rounding.

The first-call check judges a replacement within the rounding of the least precise dtype in play; it used
to read that from the module's inputs and output only, and a causal LM's are token ids and a float32 loss:
its fused LM head and loss (the largest of the fixes) were refused at float32's tolerance for differences
of bf16's size in the embedding's gradient."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_patch_checkpointing import build

import opadvisor

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "deberta"])
def test_a_model_held_in_bf16_keeps_every_fix(family: str, reference_path) -> None:
    torch.manual_seed(0)
    original = build(family).to(torch.bfloat16).train()
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    installed = set(opadvisor.patch_report(patched).patched)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no first-call check may fail
        got = patched(input_ids=ids, labels=ids).loss
        got.backward()
    want = original(input_ids=ids, labels=ids).loss
    assert set(opadvisor.patch_report(patched).patched) == installed and installed
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0)

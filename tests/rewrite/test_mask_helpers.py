"""The attention chain read through a module-level helper of the same file that only adds a mask (timm's
`maybe_add_mask`): the forms that are read through, and those that are not (their fixture pair, with values
and gradients compared, is tests/rewrite/fixtures/*/helper_adds_optional_mask)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opadvisor.rewrite.base import Target
from opadvisor.rewrite.engine import rewrite_source
from opadvisor.rules.attention import AttentionFacts

ATTENTION = """import torch
import torch.nn.functional as F
{decorator_import}

{decorators}def add_mask(a, b):
    {body}


def attend(q, k, v, mask):
    s = q @ k.transpose(-2, -1)
    s = add_mask({args})
    p = F.softmax(s, dim=-1)
    return p @ v
"""


def _sdpa(tmp_path: Path, *, body: str, args: str = "s, mask", decorators: str = "", imp: str = "") -> str:
    source = ATTENTION.format(body=body, args=args, decorators=decorators, decorator_import=imp)
    path = tmp_path / "m.py"
    path.write_text(source)
    after, _ = rewrite_source(source.encode(), "sdpa_attention", None, path)
    return after.decode()


@pytest.mark.parametrize(
    "body, args",
    [
        ("return a if b is None else a + b", "s, mask"),
        ("return a + b if b is not None else a", "s, mask"),
        ("return a + b", "s, mask"),
        ("return a + b", "mask, s"),  # a plain sum: the chain's own value is the scores either way
        ('"""Adds the mask."""\n    return b + a', "s, mask"),
    ],
)
def test_a_mask_adding_helper_is_read_through(tmp_path: Path, body: str, args: str) -> None:
    after = _sdpa(tmp_path, body=body, args=args)
    assert "return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)" in after, after
    assert "add_mask(s" not in after and "add_mask(mask" not in after


def test_identity_decorators_of_torch_fx_are_read_through(tmp_path: Path) -> None:
    after = _sdpa(tmp_path, body="return a if b is None else a + b", decorators="@torch.fx.wrap\n", imp="")
    assert "attn_mask=mask" in after


@pytest.mark.parametrize(
    "body, args, decorators",
    [
        ("return a * b", "s, mask", ""),  # not an add
        ("a = a + 1\n    return a + b", "s, mask", ""),  # more than the add
        ("return a if b is None else a + b", "s, mask=mask", ""),  # not plain positional arguments
        ("return a if b is None else a + b", "s, mask", "@functools.lru_cache\n"),  # a decorator that wraps
        ("return a if a is None else a + b", "s, mask", ""),  # the scores tested for None
    ],
)
def test_other_helpers_are_not_read_through(tmp_path: Path, body: str, args: str, decorators: str) -> None:
    after = _sdpa(tmp_path, body=body, args=args, decorators=decorators, imp="import functools")
    assert "scaled_dot_product_attention" not in after


def _refusal(tmp_path: Path, source: str, *, qk: int, softmax: int, pv: int) -> str:
    """The one refusal of `source`'s attention, profiled as q @ k^T, softmax and the product with v."""
    path = tmp_path / "m.py"
    path.write_text(source)
    lines = {"qk": [qk, qk], "softmax": [softmax, softmax], "pv": [pv, pv]}
    facts = AttentionFacts(ops=["qk", "softmax", "pv"], lines=lines)
    after, result = rewrite_source(source.encode(), "sdpa_attention", [Target(qk, pv, facts)], path)
    assert after.decode() == source
    (skipped,) = result.skipped
    return skipped.message


TIMM_SHAPE = """import torch
import torch.nn.functional as F


def maybe_add_mask(scores, attn_mask=None):
    return scores if attn_mask is None else scores + attn_mask


def mask_for(n, attn, attn_mask):
    return attn.new_zeros((n, n)) if attn_mask is None else attn_mask


def attend(q, k, v, n, attn_mask):
    attn = q @ k.transpose(-2, -1)
    attn_bias = mask_for(n, attn, attn_mask)
    attn = maybe_add_mask(attn, attn_bias)
    attn = F.softmax(attn, dim=-1)
    return attn @ v
"""


def test_the_scores_read_between_the_product_and_the_chain_are_named(tmp_path: Path) -> None:
    """timm's eager attention builds its mask from the scores between q @ k^T and the mask step: not
    rewritten, and the reason names that line (not the helper's)."""
    message = _refusal(tmp_path, TIMM_SHAPE, qk=14, softmax=17, pv=18)
    assert "`attn` (q @ k^T) is read at line 15 (`attn_bias = mask_for(n, attn, attn_mask)`)" in message


SWITCHED = """import torch
import torch.nn.functional as F


def attend(q, k, v, n, attn_mask, fused):
    if fused:
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    else:
        attn = q @ k.transpose(-2, -1)
        attn_bias = attn.new_zeros((n, n)) if attn_mask is None else attn_mask
        attn = attn + attn_bias
        attn = F.softmax(attn, dim=-1)
        x = attn @ v
    return x
"""


def test_a_refusal_in_the_else_of_an_sdpa_switch_names_the_switch(tmp_path: Path) -> None:
    """timm's `if self.fused_attn:` / nanoGPT's `if self.flash:`: the code already has the fused path."""
    message = _refusal(tmp_path, SWITCHED, qk=9, softmax=12, pv=13)
    assert message.startswith("not rewritten: the scores come from line 11")  # the profile saw no add
    assert message.endswith(
        "; the `if fused:` at line 6 already calls scaled_dot_product_attention, and this branch runs only "
        "where that is false"
    )

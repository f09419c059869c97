"""A fast, deterministic sample of the ecosystem check (benchmarks/ecosystem.py): `opadvisor apply --rule all
--unsafe FILE` over real model files taken from the installed transformers, timm and vit-pytorch, each
copied into a temp folder of its own. Per file: no crash, no hang (a generous per-file timeout detects one:
it is not a timing assertion), the rewrite compiles, a second apply changes nothing.

The sample holds the files issue 29 found hanging (deberta_v2, llama, falcon, xlnet, big_bird, qwen2_vl,
afmoe, autoformer) and a few timm and vit-pytorch files. The whole set: `python3 benchmarks/ecosystem.py`.
"""

from __future__ import annotations

import pytest
from ecosystem import BAD, discover, run_files, sample

SAMPLE = (
    # CI's share of the whole set (benchmarks/ecosystem.py): the suite must stay near 10 minutes on 2 cores,
    # and each of these costs 5-25 CPU s (deberta_v2 and qwen2_vl were among issue 29's hangs)
    "transformers/models/deberta_v2/modeling_deberta_v2.py",
    "transformers/models/llama/modeling_llama.py",
    "transformers/models/qwen2_vl/modeling_qwen2_vl.py",
    "timm/models/convnext.py",
    "vit_pytorch/vit.py",
)
HANG_TIMEOUT = 60.0  # seconds: far above any file's apply once source analysis is bounded (issue 29: ~2 s)
KNOWN_HANG_TIMEOUT = 15.0  # the files known to hang today are given less CPU time before they count as hung

# Files that fail today (main after h1 and h2 merged; measured on an H200 host, 16 at a time, and here),
# until issue 29's fixes are complete. A hang is strict (an entry must go once its file passes); "over budget"
# (rule passes that give up: "not checked: source analysis over budget", so the file is rewritten partly or
# not at all) depends on the CPU, so those entries are not strict.
_OVER = "rule passes give up: source analysis over budget (the file is left partly or wholly unchecked)"
KNOWN: dict[str, tuple[str, bool]] = {
    "timm/models/vision_transformer.py": ("hangs in activation_checkpointing (> 60 CPU s)", True),
    "timm/models/convnext.py": (f"9 {_OVER}", False),
    "transformers/models/llama/modeling_llama.py": (
        f"2 {_OVER} on a 2-core dev machine (none on the H200 host)",
        False,
    ),
    "timm/models/swin_transformer.py": (f"6 {_OVER}", False),
    "transformers/models/afmoe/modeling_afmoe.py": (f"2 {_OVER}", False),
    "transformers/models/autoformer/modeling_autoformer.py": (f"4 {_OVER}", False),
    "transformers/models/big_bird/modeling_big_bird.py": (f"13 {_OVER}", False),
    "transformers/models/deberta_v2/modeling_deberta_v2.py": (f"8 {_OVER}", False),
    "transformers/models/falcon/modeling_falcon.py": (f"7 {_OVER}", False),
    "transformers/models/qwen2_vl/modeling_qwen2_vl.py": (f"4 {_OVER}", False),
    "transformers/models/xlnet/modeling_xlnet.py": (f"8 {_OVER}", False),
}


@pytest.fixture(scope="module")
def outcomes() -> dict:
    files = [f for f in discover(say=lambda _: None) if f.key in SAMPLE]
    if not files:
        pytest.skip("none of transformers, timm, vit-pytorch is installed")
    known = [f for f in files if f.key in KNOWN and KNOWN[f.key][1]]  # the known hangs
    others = [f for f in files if f not in known]
    found = run_files(others, jobs=2, timeout=HANG_TIMEOUT) + run_files(
        known, jobs=2, timeout=KNOWN_HANG_TIMEOUT
    )
    return {o.file: o for o in found}


def _case(key: str):  # noqa: ANN202 - a pytest param
    if key not in KNOWN:
        return pytest.param(key, id=key.split("/")[-1])
    reason, strict = KNOWN[key]
    marks = [pytest.mark.xfail(strict=strict, reason=f"issue 29: {reason}")]
    return pytest.param(key, marks=marks, id=key.split("/")[-1])


@pytest.mark.slow
@pytest.mark.parametrize("key", [_case(k) for k in SAMPLE])
def test_apply_all_on_real_model_file(outcomes: dict, key: str) -> None:
    if key not in outcomes:
        pytest.skip(f"{key.split('/')[0]} is not installed")
    o = outcomes[key]
    assert o.status not in BAD, f"{key}: {o.status}: {o.detail}"
    assert o.exit_status == 0, f"{key}: exit {o.exit_status}: {o.detail}"
    assert not o.rule_errors, f"{key}: rules failed inside --rule all: {o.rule_errors}"
    assert not o.over_budget, f"{key}: {len(o.over_budget)} rule passes gave up: {o.over_budget[:3]}"


def test_the_sample_is_deterministic_and_spread_over_the_zoos() -> None:
    files = discover(say=lambda _: None)
    if not files:
        pytest.skip("no zoo installed")
    first, second = sample(files, 30), sample(list(reversed(files)), 30)
    assert [f.key for f in first] == [f.key for f in second]
    assert len({f.zoo for f in first}) == len({f.zoo for f in files})

"""A fast, deterministic sample of the ecosystem check (benchmarks/ecosystem.py): `opadvisor apply --rule all
--unsafe FILE` over real model files taken from the installed transformers, timm and vit-pytorch, each
copied into a temp folder of its own. Per file: no crash, no hang (a generous per-file timeout detects one:
it is not a timing assertion), the rewrite compiles, a second apply changes nothing.

The sample: DeBERTa-v2 (issue 29 found it hanging), Llama, timm's ConvNeXt and vit-pytorch's ViT. The whole
set (issue 29's other hangs among it: falcon, xlnet, big_bird, qwen2_vl, afmoe, autoformer):
`python3 benchmarks/ecosystem.py`.
"""

from __future__ import annotations

import pytest
from ecosystem import BAD, discover, run_files, sample

SAMPLE = (
    # CI's share of the whole set (benchmarks/ecosystem.py): the suite must stay near 10 minutes on 2 cores,
    # and each of these costs 5-25 CPU s (deberta_v2 was among issue 29's hangs;
    # qwen2_vl, another, is checked by benchmarks/ecosystem.py)
    "transformers/models/deberta_v2/modeling_deberta_v2.py",
    "transformers/models/llama/modeling_llama.py",
    "timm/models/convnext.py",
    "vit_pytorch/vit.py",
)
HANG_TIMEOUT = 60.0  # seconds: far above any file's apply once source analysis is bounded (issue 29: ~2 s)
KNOWN_HANG_TIMEOUT = 15.0  # a file known to hang is given less CPU time before it counts as hung

# Files known to fail, with the reason, and whether the failure is strict (an entry must go once its file
# passes). None today: on the H100 host's whole-set run of this session (585 of 689 files, 16 at a time) no
# file hung, crashed, went over its analysis budget or was unstable (benchmarks/RESULTS.md, twelfth session).
KNOWN: dict[str, tuple[str, bool]] = {}


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

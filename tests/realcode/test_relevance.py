"""The source-word filter (rewrite/_relevance.py) changes no output: on real model files, every codemod
in static mode writes the same bytes and says the same things with the filter as without it (where a pass
reads every top-level statement of every file).

`python3 benchmarks/ecosystem.py --compare-filter` runs the same comparison over the whole set.
"""

from __future__ import annotations

import pytest
from ecosystem import discover, filter_differences

FILES = (
    # a few CPU seconds each: the whole set (DeBERTa's StableDropout and XSoftmax, seeds named by their
    # callers, among them) is compared by the benchmark
    "transformers/models/gpt2/modeling_gpt2.py",
    "vit_pytorch/vit.py",
)


@pytest.mark.slow
@pytest.mark.parametrize("key", FILES, ids=[k.split("/")[-1] for k in FILES])
def test_filter_changes_no_output(key: str) -> None:
    found = [f for f in discover(say=lambda _: None) if f.key == key]
    if not found:
        pytest.skip(f"{key.split('/')[0]} is not installed")
    assert filter_differences(found[0].path) == []

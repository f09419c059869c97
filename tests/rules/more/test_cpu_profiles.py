"""The GPU-only rules on CPU profiles: no findings, and one note each saying a CUDA profile is needed."""

from __future__ import annotations

import pytest

from opadvisor.rules.engine import analyse

from .conftest import line_of, lines

GPU_ONLY = ["host_sync", "dataloader_stall", "fp32_gemm", "fused_optimizer"]


@pytest.mark.parametrize("name", ["example:bert_train", "example:gpt_train", "sync_item"])
def test_gpu_only_rules_do_not_fire_on_cpu(cpu_profile, name: str) -> None:
    prof = cpu_profile(name)
    assert not prof.has_gpu
    report = analyse([prof], select=GPU_ONLY)
    assert report.findings == []
    notes = {n.rule: n.message for n in report.notes}
    assert set(notes) == set(GPU_ONLY)
    assert all("needs a CUDA profile" in m for m in notes.values())


def test_host_sync_note_names_the_item_line(cpu_profile) -> None:
    (note,) = analyse([cpu_profile("sync_item")], select=["host_sync"]).notes
    assert f"sync_item.py:{lines('sync_item', 'host_sync')[0]}" in note.message


def test_host_sync_note_leaves_out_the_optimizers_own_reads(cpu_profile) -> None:
    """AdamW reads its CPU step counters with .item() inside step(): no GPU sync there, so not named."""
    (note,) = analyse([cpu_profile("example:gpt_train")], select=["host_sync"]).notes
    assert f"gpt_train.py:{line_of('example:gpt_train', '{loss.item():')}" in note.message
    assert f"gpt_train.py:{line_of('example:gpt_train', 'optimizer.step()')}" not in note.message

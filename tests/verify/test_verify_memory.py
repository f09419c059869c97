"""verify's peak memory: per-step CUDA peaks from the harness, summarised before and after (GPU marked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opadvisor.verify.compare import Parity, PeakMemory, peak_memory, speedup, summarise
from opadvisor.verify.core import Timing, VerifyReport

GIB = 1 << 30


def _run(peaks: list[tuple[int, int] | None]) -> dict:
    steps = []
    for i, peak in enumerate(peaks, 1):
        step = {"index": i, "losses": [], "end_s": float(i)}
        if peak is not None:
            step["peak_allocated_bytes"], step["peak_reserved_bytes"] = peak
        steps.append(step)
    return {"steps": steps}


def test_peaks_leave_out_the_warmup_and_take_the_largest_over_runs():
    runs = [
        _run([(9 * GIB, 10 * GIB), (2 * GIB, 3 * GIB), (3 * GIB, 4 * GIB)]),
        _run([(9, 9), (4 * GIB, 4 * GIB)]),
    ]
    assert peak_memory(runs, warmup=1) == PeakMemory(4 * GIB, 4 * GIB, 3)


def test_no_peaks_without_cuda():
    assert peak_memory([_run([None, None, None])], warmup=1) is None


def test_report_json_has_both_peaks():
    times = summarise([10.0, 11.0, 12.0])
    timing = Timing(
        "cuda",
        1,
        1,
        times,
        times,
        speedup(times, times),
        PeakMemory(4 * GIB, 5 * GIB, 3),
        PeakMemory(GIB, 2 * GIB, 3),
    )
    report = VerifyReport(
        "run",
        "train.py",
        ["activation_checkpointing"],
        Parity(ok=True, precision="fp32", rtol=1e-4, atol=1e-5, message="ok"),
        timing=timing,
    )
    peaks = report.to_dict()["timing"]["peak_memory"]
    assert peaks["before"] == {"allocated_bytes": 4 * GIB, "reserved_bytes": 5 * GIB, "steps": 3}
    assert peaks["after"]["allocated_bytes"] == GIB and peaks["allocated_change"] == pytest.approx(-0.75)
    timing.memory_after = None
    assert (
        VerifyReport(
            "run",
            "t.py",
            [],
            Parity(ok=True, precision="fp32", rtol=1e-4, atol=1e-5, message="ok"),
            timing=timing,
        ).to_dict()["timing"]["peak_memory"]
        is None
    )


@pytest.mark.gpu
def test_harness_records_each_steps_peak_on_cuda(tmp_path: Path):
    """The child records a peak per step in timing mode; a step that allocates more peaks higher."""
    script = tmp_path / "grow.py"
    script.write_text(
        "import torch\n"
        "w = torch.zeros(4, device='cuda', requires_grad=True)\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for i in range(4):\n"
        "    big = torch.ones((i + 1) * (1 << 26), device='cuda')  # 256 MiB more each step\n"
        "    loss = (w.sum() + big.sum() * 0).float()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    del big\n"
    )
    config = {
        "script": str(script),
        "argv": [str(script)],
        "cwd": str(tmp_path),
        "steps": 4,
        "warmup": 0,
        "mode": "timing",
        "seed": 0,
        "sources": {},
        "result": str(tmp_path / "result.json"),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "OPADVISOR_VERIFY_CONFIG": str(tmp_path / "config.json")}
    subprocess.run(
        [sys.executable, "-m", "opadvisor.verify.harness"], env=env, cwd=tmp_path, check=True, timeout=300
    )
    steps = json.loads((tmp_path / "result.json").read_text())["steps"]
    peaks = [s["peak_allocated_bytes"] for s in steps]
    assert all(b - a >= (1 << 28) for a, b in zip(peaks, peaks[1:], strict=False)), peaks
    assert all(s["peak_reserved_bytes"] >= s["peak_allocated_bytes"] for s in steps)

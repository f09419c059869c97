"""Memory in the profile: activation memory by module (saved-tensor hooks, on the CPU), CUDA peaks (GPU)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from cli_testlib import opadvisor_here

from opadvisor.profile.memory import MemoryRecorder, activation_holders, block_groups
from opadvisor.profile.model import ModuleCall, Profile, Step, load_profile, profile_from_dict
from opadvisor.profile.modules import weights_flat

SCRIPTS = Path(__file__).parent / "scripts"
FLOAT = 4


def _recorded(fn) -> dict:
    """Run fn() inside one recorder step (module "m" running); return what each key saved."""
    model = nn.Linear(8, 8)
    rec = MemoryRecorder(cuda=False)
    rec.add_root(model)
    rec.start_step()
    rec.enter(("m", "M"))
    out = fn(model)
    rec.exit()
    step = rec.end_step()
    out.sum().backward()
    return {"step": step, "model": model}


def test_each_storage_is_counted_once_and_parameters_are_not_activations():
    x = torch.randn(4, 8)

    def two_ops_save_the_same_tensor(model):
        h = model(x)  # saves x (an input: counted) and the weight (a parameter: left out)
        return torch.tanh(h) * h  # tanh saves its output; mul saves tanh's output and h

    step = _recorded(two_ops_save_the_same_tensor)["step"]
    nbytes, storages = step.by_module[("m", "M")]
    assert storages == 3  # x, h, tanh(h): each once
    assert nbytes == 3 * 4 * 8 * FLOAT
    assert step.saved_bytes == nbytes


def test_saved_outside_every_module_is_kept_apart():
    model = nn.Linear(8, 8)
    rec = MemoryRecorder(cuda=False)
    rec.add_root(model)
    rec.start_step()
    rec.enter(("m", "M"))
    h = model(torch.randn(2, 8))
    rec.exit()
    loss = torch.tanh(h).sum()  # tanh outside the module
    step = rec.end_step()
    loss.backward()
    assert step.by_module[None] == [2 * 8 * FLOAT, 1]
    assert step.by_module[("m", "M")] == [2 * 8 * FLOAT, 1]


def test_inplace_change_of_a_saved_tensor_still_raises():
    """Saved-tensor hooks switch autograd's version check off; ours puts it back."""
    rec = MemoryRecorder(cuda=False)
    w = torch.randn(8, 8, requires_grad=True)
    rec.start_step()
    y = torch.tanh(torch.randn(2, 8) @ w)  # tanh saves y
    z = y.exp()
    rec.end_step()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_a_graph_dropped_without_backward_is_freed_at_once():
    rec = MemoryRecorder(cuda=False)
    w = torch.randn(8, 8, requires_grad=True)
    gc.disable()
    try:
        rec.start_step()
        y = torch.tanh(torch.randn(2, 8) @ w)  # an output saved by its own node: a cycle if held as is
        ref = weakref.ref(y)
        rec.end_step()
        del y
        assert ref() is None
    finally:
        gc.enable()


def test_gradients_are_unchanged_by_the_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    rec = MemoryRecorder(cuda=False)
    rec.add_root(model)
    rec.start_step()
    loss = model(x).sum()
    rec.end_step()
    loss.backward()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)


def test_the_scripts_own_hooks_win_and_the_step_says_so():
    rec = MemoryRecorder(cuda=False)
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        rec.start_step()
        y = torch.tanh(torch.randn(2, 8) @ w)
        step = rec.end_step()
    y.sum().backward()
    assert step.saved_bytes is None
    assert rec.notes and "not measured" in rec.notes[0]


def test_what_a_checkpoint_recomputes_is_not_held():
    block = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(4, 8, requires_grad=True)
    rec = MemoryRecorder(cuda=False)
    rec.add_root(block)
    rec.start_step()
    y = block(x)
    plain_step = rec.end_step()
    y.sum().backward()
    rec.start_step()
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    ckpt_step = rec.end_step()
    y.sum().backward()
    assert plain_step.saved_bytes >= 4 * 64 * FLOAT * 2  # the 64-wide activations
    assert (ckpt_step.saved_bytes or 0) < plain_step.saved_bytes / 4


def test_block_groups_and_holders():
    calls = [
        ModuleCall("", "M", 1, saved_bytes=0.0),
        ModuleCall("embed", "torch.nn.Linear", 1, saved_bytes=10.0),
        *(ModuleCall(f"layers.{i}", "Block", 1, saved_bytes=100.0, input_bytes=4) for i in range(3)),
        *(ModuleCall(f"layers.{i}.fc", "torch.nn.Linear", 1, saved_bytes=50.0) for i in range(3)),
        ModuleCall("layers.0.sub.0", "Tiny", 1, saved_bytes=1.0),
        ModuleCall("layers.0.sub.1", "Tiny", 1, saved_bytes=1.0),
    ]
    groups = block_groups(calls)
    assert [[c.module for c in g] for g in groups] == [["layers.0", "layers.1", "layers.2"]]
    profile = Profile(steps=[Step(0, 0, 1, 1, saved_bytes=500)], module_calls=calls)
    holders = activation_holders(profile)
    assert holders[0].name == "layers.0-2" and holders[0].saved_bytes == 452.0
    assert holders[0].input_bytes == 12
    assert [h.name for h in holders[1:]] == ["(outside modules)", "embed"]
    assert holders[1].saved_bytes == 500 - 462


def test_older_profiles_load_with_memory_unmeasured():
    step = {"index": 0, "start_us": 0, "end_us": 1, "wall_ms": 1}
    older = {"schema": 1, "script": "/p/train.py", "argv": [], "cwd": "/p", "environment": {}, "ops": []}
    prof = profile_from_dict({**older, "steps": [step]})  # the keys every schema-1 profile has
    assert prof.module_calls == [] and prof.steps[0].saved_bytes is None
    assert prof.peak_memory() == (None, None) and not prof.memory_requested


def test_weights_flat_follows_cudnn_s_test():
    lstm = nn.LSTM(4, 8, num_layers=2)
    lstm.flatten_parameters()  # a no-op on the CPU: the weights are separate tensors there
    assert not weights_flat(lstm._flat_weights)
    buf = torch.zeros(sum(w.numel() for w in lstm._flat_weights))
    views, offset = [], 0
    for w in lstm._flat_weights:
        views.append(buf[offset : offset + w.numel()].view_as(w))
        offset += w.numel()
    assert weights_flat(views)
    assert not weights_flat([views[1], views[0], *views[2:]])  # one buffer, out of order


@pytest.fixture(scope="module")
def blocks_run(script_run) -> Path:
    """blocks_train.py profiled once a test run (tests/conftest.py's script_run: the rule tests read it too)."""
    return script_run(SCRIPTS / "blocks_train.py")


def test_profile_prints_the_activation_memory(blocks_run: Path):
    printed = blocks_run.with_name("run.stdout.txt").read_text()
    assert "Memory: " in printed and "blocks.0-3 (Block x4)" in printed


def test_profiled_script_records_activation_memory_by_module(blocks_run: Path):
    prof = load_profile(blocks_run / "profile.json")
    calls = {c.module: c for c in prof.module_calls}
    x = 4 * 8 * 32 * FLOAT  # one [batch, seq, d] activation
    stats = 2 * 4 * 8 * FLOAT  # LayerNorm's mean and rstd
    for i in range(4):
        block = calls[f"blocks.{i}"]
        assert block.module_class == "__main__.Block"
        assert block.saved_bytes == 4 * x  # gelu's input (4d wide)
        assert calls[f"blocks.{i}.norm"].saved_bytes == x + stats
        assert calls[f"blocks.{i}.up"].saved_bytes == x
        assert calls[f"blocks.{i}.down"].saved_bytes == 4 * x
        assert block.calls == 2 and block.input_bytes == x
        script = str((SCRIPTS / "blocks_train.py").resolve())
        assert (block.file, block.function) == (script, "forward")
        assert "x = block(x)" in (SCRIPTS / "blocks_train.py").read_text().splitlines()[block.line - 1]
    assert calls["embed"].saved_bytes == 4 * 8 * 16 * FLOAT  # its input; its output is the next one's
    assert all(s.saved_bytes and s.peak_allocated_bytes is None for s in prof.steps)
    holders = activation_holders(prof)
    assert holders[0].name == "blocks.0-3" and holders[0].saved_bytes == 4 * (10 * x + stats)


def test_suggest_json_has_the_memory_section(blocks_run: Path):
    jsonschema = pytest.importorskip("jsonschema")
    from opadvisor.rules.suggest_schema import SUGGEST_SCHEMA

    proc = opadvisor_here(blocks_run.parent, "suggest", str(blocks_run), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, SUGGEST_SCHEMA)
    memory = doc["memory"]
    assert memory["peak_allocated_bytes"] is None  # a CPU run
    assert memory["holders"][0]["name"] == "blocks.0-3"
    assert memory["holders"][0]["modules"] == [f"blocks.{i}" for i in range(4)]
    assert 0.5 < memory["holders"][0]["share"] < 1


def test_no_activations_flag_measures_none(tmp_path: Path):
    cmd = [sys.executable, "-m", "opadvisor", "profile", str(SCRIPTS / "blocks_train.py"), "--no-activations"]
    cmd += ["--steps", "1", "--warmup", "1", "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prof = load_profile(tmp_path / "run" / "profile.json")
    assert all(s.saved_bytes is None for s in prof.steps)
    assert all(c.saved_bytes is None for c in prof.module_calls) and prof.module_calls


@pytest.mark.gpu
def test_cuda_peaks_per_step(tmp_path: Path):
    cmd = [sys.executable, "-m", "opadvisor", "profile", str(SCRIPTS / "blocks_train.py")]
    cmd += ["--steps", "2", "--warmup", "1", "--out", str(tmp_path / "run"), "--", "--batch", "64"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prof = load_profile(tmp_path / "run" / "profile.json")
    for step in prof.steps:
        assert step.allocated_at_start_bytes is not None and step.allocated_at_start_bytes > 0
        assert step.peak_allocated_bytes >= step.allocated_at_start_bytes + (step.saved_bytes or 0)
        assert step.peak_reserved_bytes >= step.peak_allocated_bytes
    assert prof.environment.gpu_memory_bytes and "reserved of" in proc.stdout

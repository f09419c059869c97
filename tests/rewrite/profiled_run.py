"""A run folder from code profiled in this process: write a module, profile its `make_inputs()` callable for a
training step (forward, a weighted sum of the outputs, backward), save the run as `opadvisor profile` would.

    run_dir = profile_module(tmp_path, "model.py", SOURCE)   # tmp_path is the cwd (the project)
"""

from __future__ import annotations

from pathlib import Path

import torch

from opadvisor.profile.model import save_profile
from opadvisor.profile.runner import profile_steps
from opadvisor.profile.runs import PROFILE_FILE, mark_latest, state_dir


def weighted_loss(out) -> torch.Tensor:
    outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, torch.Tensor)]
    generator = torch.Generator(device="cpu").manual_seed(1)
    return sum((o * torch.randn(o.shape, generator=generator)).sum() for o in outs)


def profile_module(root: Path, name: str, source: str) -> Path:
    """Write `source` to root/name, profile one step of its make_inputs() callable, save the run (latest)."""
    path = root / name
    path.write_text(source)
    namespace: dict = {"__name__": path.stem}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - the test's own source
    torch.manual_seed(0)
    fn, args = namespace["make_inputs"]()

    def step() -> None:
        weighted_loss(fn(*args)).backward()

    profile = profile_steps(step, path, steps=1, warmup=1)
    run_dir = state_dir(root) / "runs" / "r1"
    run_dir.mkdir(parents=True)
    profile.run_id = run_dir.name
    save_profile(profile, run_dir / PROFILE_FILE)
    mark_latest(run_dir)
    return run_dir

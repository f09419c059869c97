"""Issue 30 item 6: the step breakdown's parts add up to what its shares are of, on CPU and GPU profiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opadvisor.profile.model import Environment, Op, Profile, Step
from opadvisor.profile.runner import profile_steps
from opadvisor.rules._index import index_of
from opadvisor.rules.overview import breakdown
from tests.fixture_profiles import DATA, gpu_busy_ms, load_fixture_profile, with_plain_step

GPU_FIXTURES = sorted(p.name.removesuffix(".profile.json") for p in DATA.glob("*.profile.json"))


def assert_adds_up(bd: dict) -> None:
    parts = bd["parts"]
    assert sum(p["ms"] for p in parts) == pytest.approx(bd["total_ms"], rel=1e-3, abs=1e-3)
    assert sum(p["share"] for p in parts) == pytest.approx(1.0, abs=0.01)
    assert all(p["ms"] >= 0 for p in parts)


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_gpu_breakdown_adds_up_with_and_without_a_plain_step(name: str) -> None:
    profile = load_fixture_profile(name)
    bd = breakdown(profile)
    assert_adds_up(bd)
    assert bd["of"] == "the mean GPU span of a step"
    bd = breakdown(with_plain_step(profile, gpu_busy_ms(profile) + 0.5))
    assert_adds_up(bd)
    # the step the findings' shares are of too: the plain step, kept within GPU busy .. profiled span
    base = index_of(profile).calibration.share_base_ms
    assert bd["of"].startswith("the plain step") and bd["total_ms"] == pytest.approx(base, rel=1e-3)


def _op(i: int, name: str, start: float, dur: float, thread: int, parent: int | None = None) -> Op:
    return Op(id=i, name=name, step=0, start_us=start, duration_us=dur, thread=thread, parent=parent)


def test_cpu_ops_overlapping_across_threads_and_nested_are_counted_once() -> None:
    # a 1000 us step: thread 1 runs an op 0-600 with a matmul nested at 100-400; thread 2 runs a matmul
    # 300-700 and another op 650-800. Summed, op time is 1050 us (105% of the step): the instants are
    # 0-800 under some op, of them 100-700 under a matmul; 200 us ran no op
    ops = [
        _op(0, "aten::linear_like", 0, 600, 1),
        _op(1, "aten::mm", 100, 300, 1, parent=0),
        _op(2, "aten::mm", 300, 400, 2),
        _op(3, "aten::add", 650, 150, 2),
    ]
    profile = Profile(
        environment=Environment(device="cpu"), steps=[Step(0, 0.0, 1000.0, 1.0)], ops=ops, steps_requested=1
    )
    bd = breakdown(profile)
    parts = {p["name"]: p["ms"] for p in bd["parts"]}
    assert parts == {
        "matrix products": 0.6,
        "other ops": 0.2,
        "data loading": 0.0,
        "Python and framework": 0.2,
    }
    assert bd["total_ms"] == 1.0 and bd["of"] == "the mean step's wall time"
    assert_adds_up(bd)


def test_real_cpu_profile_adds_up(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 64)), batch_size=32)
    batches = iter(loader)

    def step() -> None:
        (x,) = next(batches)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    profile = profile_steps(step, Path(__file__), steps=3, warmup=1)
    bd = breakdown(profile)
    assert_adds_up(bd)
    mean_wall = sum(s.wall_ms for s in profile.steps) / len(profile.steps)
    assert bd["total_ms"] == pytest.approx(mean_wall, rel=1e-3)
    assert {p["name"] for p in bd["parts"] if p["ms"] > 0} >= {"matrix products", "other ops"}

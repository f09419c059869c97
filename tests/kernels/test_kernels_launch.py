"""The direct launcher: its specialisation follows what Triton specialises on (the GPU tests check every
direct launch against it: conftest sets CHECK_KEYS), and on a GPU the direct launches compute what Triton's
own launches compute (aligned and misaligned tensors, new shapes, new dtypes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_testutil import record_launches, rel_err
from opadvisor.kernels import _launch, dropout_add, masked_softmax, reference_masked_softmax, softmax


def _fake_kernel():
    params = [
        SimpleNamespace(name="X", is_constexpr=False, do_not_specialize=False),
        SimpleNamespace(name="n", is_constexpr=False, do_not_specialize=False),
        SimpleNamespace(name="seed", is_constexpr=False, do_not_specialize=True),
        SimpleNamespace(name="scale", is_constexpr=False, do_not_specialize=False),
        SimpleNamespace(name="BLOCK", is_constexpr=True, do_not_specialize=False),
    ]
    return SimpleNamespace(params=params)


def test_key_follows_triton_specialisation():
    launcher = _launch.Launcher(_fake_kernel())
    x = torch.empty(64, dtype=torch.float32)
    meta = {"BLOCK": 32}

    def key(t, n, seed, scale=0.5, m=meta):
        return launcher.specialisation(0, (t, n, seed, scale), m)

    assert key(x, 64, 7) == key(x, 64, 99)  # a new seed (not specialised on): the same kernel
    assert key(x, 64, 7) != key(x, 65, 7)  # specialised integers: by value (covers ÷16 and == 1)
    assert key(x, 64, 7) != key(x, 2**40, 7)
    assert key(x, 64, 7) != key(x, 64, 2**40)  # a seed's type (int32 / int64) counts, not its value
    assert key(x, 64, 7) != key(x, 64, 7, scale=1)  # an int where a float was: another signature
    assert key(x, 64, 7) != key(x.to(torch.bfloat16), 64, 7)  # dtype
    assert key(x, 64, 7) != key(x[1:], 64, 7)  # 16-byte alignment of the address
    assert key(x, 64, 7) != key(x, 64, 7, m={"BLOCK": 64})  # constexprs
    with pytest.raises(TypeError):
        launcher.specialisation(0, (x, 64), meta)


def test_launch_hooks_send_launches_through_triton():
    """A profiler's launch hook (a function, or a non-empty HookChain since Triton 3.5) must see every
    launch, so only unset hooks allow the direct path."""
    assert not _launch._hook_set(None)
    assert not _launch._hook_set(SimpleNamespace(calls=[]))  # an empty HookChain
    assert _launch._hook_set(SimpleNamespace(calls=[print]))
    assert _launch._hook_set(print)


def test_interpreted_kernels_always_go_through_triton():
    launcher = _launch.Launcher(SimpleNamespace())  # an InterpretedFunction has no `params`
    assert not launcher.direct


@pytest.mark.gpu
def test_direct_launches_match_reference_on_gpu(monkeypatch):
    """Repeated calls go through the direct path (the cache fills) and stay exact: an aligned tensor,
    then misaligned views, another row length and dtype, each checked against the reference."""
    monkeypatch.setattr(softmax, "SMALL_NUMEL", 0)
    monkeypatch.setattr(dropout_add, "SMALL_NUMEL", 0)
    assert _launch.direct_launch_available()
    torch.manual_seed(0)
    base = torch.randn(8 * 301 + 1, device="cuda")
    cases = [base[: 8 * 300].view(8, 300), base[1 : 1 + 8 * 300].view(8, 300), base[: 8 * 301].view(8, 301)]
    cases += [c.to(torch.bfloat16) for c in cases]
    launches = record_launches(monkeypatch, keep=lambda launch, args: launch)
    for x in cases:
        for _ in range(3):  # the first call compiles through Triton, the next ones launch directly
            y = masked_softmax(x, scale=0.5)
            assert rel_err(y.float(), reference_masked_softmax(x.float(), scale=0.5)) < 1e-2
    assert all(launch.compiled for launch in launches), "the direct path was never taken"
    assert _launch.CHECK_KEYS  # every direct launch was checked against its compiled kernel's specialisation

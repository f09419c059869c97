"""opadvisor.kernels.AdamW: torch's fused AdamW's values, torch's state (both ways), torch's step where the
kernel does not apply (said once), hooks and GradScaler as for torch's optimizers.

The reference is `torch.optim.AdamW(..., fused=True)`, which computes in float32 whatever the storage dtype
as the kernel does (the default foreach path rounds to a 16-bit parameter's dtype after each operation).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from opadvisor.kernels import AdamW, dispatch_counts, reset_dispatch_counts
from opadvisor.kernels import adamw as adamw_module

SHAPES = [(300,), (7, 11), (1,), (0,), (129, 3)]  # several blocks, one partial block, one element, empty


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """64-element blocks: several programs per tensor at sizes the interpreter runs in a moment; and the
    once-per-process fallback warnings afresh for each test (as tests/kernels/test_kernels_dispatch.py)."""
    monkeypatch.setattr(adamw_module, "BLOCK", 64)
    monkeypatch.setattr(adamw_module, "NUM_WARPS", 2)
    monkeypatch.setattr(adamw_module._dispatch, "_WARNED", set())


def twins(device, dtype=torch.float32, shapes=SHAPES, seed=0):
    """Two lists of equal leaf parameters."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]
    return [v.clone().requires_grad_() for v in values], [v.clone().requires_grad_() for v in values]


def give_grads(a, b, seed):
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(a, b, strict=True):
        grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
        p.grad, q.grad = grad.clone(), grad.clone()


def tolerance(dtype: torch.dtype) -> dict:
    """assert_close's defaults for float32; 4 units in the last place for 16-bit storage, where the CPU's
    fused AdamW (which computes the moments another way, lerp) rounds an occasional element the other way
    and the difference carries into the next steps' moments."""
    if dtype in (torch.bfloat16, torch.float16):
        eps = torch.finfo(dtype).eps
        return {"rtol": 4 * eps, "atol": 1e-3 if dtype == torch.bfloat16 else 1e-4}
    return {}


def assert_same_state(ours, ref, a, b):
    for p, q in zip(a, b, strict=True):
        tol = tolerance(p.dtype)
        torch.testing.assert_close(p, q, **tol)
        s, t = ours.state[p], ref.state[q]
        if not t:
            assert not s
            continue
        torch.testing.assert_close(s["exp_avg"], t["exp_avg"], **tol)
        torch.testing.assert_close(s["exp_avg_sq"], t["exp_avg_sq"], **tol)
        assert float(s["step"]) == float(t["step"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_steps_are_torch_fused_adamw_steps(device, dtype):
    a, b = twins(device, dtype)
    ours = AdamW(a, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True)
    reset_dispatch_counts()
    for step in range(3):
        give_grads(a, b, seed=step)
        for opt in (ours, ref):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # as a scheduler changes it between steps
        ours.step()
        ref.step()
    assert_same_state(ours, ref, a, b)
    expected = "triton" if device.type == "cuda" else "interpreter"
    assert dispatch_counts()["adamw"] == {expected: 3}


def test_groups_keep_their_options_and_parameters_without_gradients_are_left_alone(device):
    a, b = twins(device)

    def groups(ps):
        return [
            {"params": ps[:2], "lr": 1e-2, "weight_decay": 0.0},
            {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.5, "betas": (0.5, 0.9)},
        ]

    ours, ref = AdamW(groups(a)), torch.optim.AdamW(groups(b), fused=True)
    give_grads(a, b, seed=1)
    a[0].grad = b[0].grad = None  # never has a gradient: no state, not moved
    frozen = a[0].detach().clone()
    for _ in range(2):
        ours.step()
        ref.step()
    assert_same_state(ours, ref, a, b)
    assert not ours.state[a[0]] and torch.equal(a[0], frozen)


def test_parameters_at_different_step_counts_each_get_their_own_bias_correction(device):
    a, b = twins(device)
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    give_grads(a, b, seed=2)
    a[1].grad = b[1].grad = None  # skipped at the first step: one step behind the others afterwards
    ours.step()
    ref.step()
    for step in range(2):
        give_grads(a, b, seed=3 + step)
        ours.step()
        ref.step()
    assert float(ours.state[a[1]]["step"]) == 2 and float(ours.state[a[0]]["step"]) == 3
    assert_same_state(ours, ref, a, b)


def test_a_checkpoint_moves_between_torch_and_opadvisor_both_ways(device):
    a, b = twins(device)
    ours, ref = (
        AdamW(a, lr=1e-2, weight_decay=0.1),
        torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True),
    )
    give_grads(a, b, seed=0)
    ours.step()
    ref.step()
    # opadvisor -> torch: a fresh torch optimizer on the same parameters continues where ours stopped
    moved = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, fused=True)
    moved.load_state_dict(ours.state_dict())
    # torch (fused: `step` counters on the parameters' device) -> opadvisor
    back = AdamW(b, lr=1e-2, weight_decay=0.1)
    back.load_state_dict(ref.state_dict())
    give_grads(a, b, seed=1)
    moved.step()
    back.step()
    assert_same_state(moved, back, a, b)
    assert all(back.state[p]["step"].device.type == "cpu" for p in b if back.state[p])


def test_a_closure_is_called_with_gradients_enabled_and_its_loss_returned(device):
    a, _ = twins(device, shapes=[(5,)])
    opt = AdamW(a)

    def closure():
        opt.zero_grad()
        loss = (a[0] ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and float(opt.state[a[0]]["step"]) == 1


@pytest.mark.parametrize(
    ("options", "said"),
    [({"amsgrad": True}, "amsgrad=True"), ({"maximize": True}, "maximize=True")],
)
def test_options_the_kernel_lacks_run_torchs_step_and_say_so_once(device, options, said):
    a, b = twins(device)
    ours, ref = AdamW(a, lr=1e-2, **options), torch.optim.AdamW(b, lr=1e-2, **options)
    reset_dispatch_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            give_grads(a, b, seed=step)
            ours.step()
            ref.step()
    said_lines = [str(w.message) for w in caught if "opadvisor.kernels.adamw" in str(w.message)]
    assert said_lines == [f"opadvisor.kernels.adamw: {said}: torch's AdamW step runs"]
    assert dispatch_counts()["adamw"] == {"reference": 2}
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q)


def test_float64_and_non_contiguous_parameters_run_torchs_step(device):
    a, b = twins(device, torch.float64)
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    give_grads(a, b, seed=0)
    with pytest.warns(RuntimeWarning, match="not torch.float64: torch's AdamW step runs"):
        ours.step()
    ref.step()
    assert_same_state(ours, ref, a, b)

    leaf = torch.randn(6, 4, device=device).t().detach().requires_grad_()  # a transposed leaf
    leaf.grad = torch.ones_like(leaf)
    with pytest.warns(RuntimeWarning, match="a non-contiguous parameter or gradient"):
        AdamW([leaf]).step()


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}], ids=["kernel", "torch"])
def test_step_hooks_run_once_per_step_on_either_path(device, options):
    a, _ = twins(device)
    opt = AdamW(a, **options)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for p in a:
        p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert calls == ["pre", "post"]


def test_gradscaler_unscales_for_it_even_where_fused_was_asked(device):
    a, _ = twins(device)
    assert AdamW(a, fused=True)._step_supports_amp_scaling is False
    assert AdamW(a)._step_supports_amp_scaling is False


def test_tables_are_made_once_and_follow_gradients_that_move(device, monkeypatch):
    """New gradient tensors each step (as zero_grad(set_to_none=True) then backward makes them, the small
    ones elsewhere each time) rewrite the tables' gradient row: the tables are made once, the layout checked
    once, and every step updates from the gradients where they are now, also from one not on 16 bytes."""
    a, b = twins(device)
    made = []
    real = adamw_module.make_tables
    monkeypatch.setattr(adamw_module, "make_tables", lambda t: made.append(1) or real(t))
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    give_grads(a, b, seed=0)
    for _ in range(2):  # the same gradient tensors
        ours.step()
        ref.step()
    checked_layout = ours._checked_layout
    for seed in (1, 2, 3, 4, 5, 6):  # more steps than STAGING_BUFFERS: every pinned buffer used again
        give_grads(a, b, seed=seed)
        if seed == 5:  # a gradient 4 bytes into its storage: the launch no longer assumes 16-byte starts
            flat = torch.zeros(1 + a[0].numel(), device=device)
            flat[1:].copy_(a[0].grad.reshape(-1))
            a[0].grad = flat[1:].view_as(a[0])
        ours.step()
        ref.step()
        assert_same_state(ours, ref, a, b)
        tables = next(iter(ours._tables.values()))
        assert tables.aligned == (seed != 5)
    assert len(made) == 1 and ours._checked_layout is checked_layout


def test_gradient_rows_are_staged_through_buffers_used_in_turn(monkeypatch):
    """The CUDA path of a gradient row (checked here with CPU stand-ins for pinned memory and events): each
    copy goes through the next of STAGING_BUFFERS buffers, and a buffer is written again only after waiting
    for the event of the copy that last read it."""
    waited = []

    class Event:
        def __init__(self, n):
            self.n = n

        def synchronize(self):
            waited.append(self.n)

    recorded = []
    monkeypatch.setattr(adamw_module, "_pinned_like", torch.empty_like)
    monkeypatch.setattr(
        adamw_module, "_recorded_event", lambda device: recorded.append(1) or Event(len(recorded))
    )
    tables = adamw_module.make_tables([tuple(torch.zeros(4) for _ in range(4))])
    target = torch.zeros(3, dtype=torch.int64)
    for i in range(adamw_module.STAGING_BUFFERS + 2):
        adamw_module._copy_staged(tables, torch.full((3,), i), target)
        assert target.tolist() == [i] * 3
    assert len(tables.staging) == adamw_module.STAGING_BUFFERS
    assert waited == [1, 2]  # the fifth and sixth copies waited for the first and second
    assert tables.staging[0][0].tolist() == [adamw_module.STAGING_BUFFERS] * 3


def test_cpu_parameters_without_the_interpreter_run_torchs_step_without_a_word(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU's implementation: torch's own step
    a, b = twins("cpu")
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    give_grads(a, b, seed=0)
    reset_dispatch_counts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.step()
    ref.step()
    assert dispatch_counts()["adamw"] == {"reference": 1}
    assert_same_state(ours, ref, a, b)


def test_a_step_counts_as_an_in_place_change_of_the_parameters_it_updates(device):
    (w,), _ = twins(device, shapes=[(4,)])
    saved = (w * w).sum()  # saves w for its backward
    w.grad = torch.ones_like(w)
    AdamW([w]).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_tensors_that_do_not_start_on_16_bytes_are_updated_all_the_same(device):
    flat = torch.randn(1 + 300 + 77, device=device)
    a = [flat[1:301].detach().requires_grad_(), flat[301:].detach().requires_grad_()]  # 4 and 1204 bytes in
    b = [p.detach().clone().requires_grad_() for p in a]
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    give_grads(a, b, seed=0)
    ours.step()
    ref.step()
    assert_same_state(ours, ref, a, b)
    assert not next(iter(ours._tables.values())).aligned


def test_a_gradient_whose_layout_changes_between_steps_is_checked_again(device):
    a, b = twins(device, shapes=[(6, 4), (5,)])
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    give_grads(a, b, seed=0)
    ours.step()  # the kernel: the layout is checked and remembered
    ref.step()
    grad = torch.randn(4, 6, device=device).t()  # the same shape, not contiguous
    a[0].grad, b[0].grad = grad, grad.clone()
    with pytest.warns(RuntimeWarning, match="a non-contiguous parameter or gradient"):
        ours.step()
    ref.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q)


def test_step_counters_survive_a_saved_checkpoint_and_keep_counting(device, tmp_path):
    a, b = twins(device)
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    for step in range(2):
        give_grads(a, b, seed=step)
        ours.step()
        ref.step()
    torch.save(ours.state_dict(), tmp_path / "opt.pt")
    resumed = AdamW(a, lr=1e-2)
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt"))
    for step in range(2, 4):
        give_grads(a, b, seed=step)
        resumed.step()
        ref.step()
    assert_same_state(resumed, ref, a, b)
    assert [float(resumed.state[p]["step"]) for p in a] == [4.0] * len(a)
    assert [float(s["step"]) for s in ours.state.values()] == [2.0] * len(a)  # the first one's, untouched


def test_a_state_loaded_into_the_same_optimizer_mid_run_is_the_one_stepped(device):
    a, b = twins(device)
    ours, ref = AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    saved = []
    for step in range(3):  # both: a step, a copy of the state, a step, that copy loaded back, a step
        give_grads(a, b, seed=step)
        for opt in (ours, ref):
            opt.step()
            if step == 0:
                saved.append(copy.deepcopy(opt.state_dict()))
            if step == 1:
                opt.load_state_dict(saved.pop(0))  # moments copied in: new tensors, new addresses
    assert_same_state(ours, ref, a, b)
    assert float(ours.state[a[0]]["step"]) == 2.0

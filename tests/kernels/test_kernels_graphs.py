"""`cuda_graphed`: the module stays the module (CPU: the original forward, untouched results), and on a GPU the
graphed forward and backward compute what the eager ones compute, through the cases that could go wrong:
gradient accumulation, zero_grad without set_to_none, a second forward before the first backward, new
shapes, eval / no_grad, autocast, buffers, hooks and captures that cannot work, keyword and static arguments
and dict-like outputs (library-style calls), and captures after earlier code left garbage behind."""

from __future__ import annotations

import gc
import subprocess
import sys
import types
import warnings
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from opadvisor.kernels import compile_region, cuda_graphed, graphs, region_state


class Tiny(nn.Module):
    def __init__(self, vocab=50, hidden=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lin = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, lengths):
        pos = torch.arange(ids.shape[1], device=ids.device)
        keep = (pos[None, :] < lengths[:, None]).unsqueeze(-1)
        x = self.emb(ids) * keep
        x = self.norm(x + F.gelu(self.lin(x)))
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x)


def _pair(device, seed=0):
    torch.manual_seed(seed)
    a = Tiny().to(device)
    b = Tiny().to(device)
    b.load_state_dict(a.state_dict())
    return a, cuda_graphed(b)


def _batch(device, batch=4, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g).to(device)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g).to(device)
    return ids, lengths


def _loss(model, ids, lengths):
    logits = model(ids, lengths)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))


def _train(model, batches, *, set_to_none=True, accumulate=1, autocast=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, (ids, lengths) in enumerate(batches):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model, ids, lengths)
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    return losses


def test_same_module_and_state_dict_on_cpu():
    torch.manual_seed(0)
    model = Tiny()
    keys = list(model.state_dict())
    ids, lengths = _batch("cpu")
    expected = model(ids, lengths)
    same = cuda_graphed(model)
    assert same is model and list(model.state_dict()) == keys
    assert isinstance(model.forward, graphs.GraphedForward)
    assert cuda_graphed(model).forward is model.forward  # idempotent
    assert torch.equal(model(ids, lengths), expected)  # CPU tensors: the original forward
    assert not model.forward.graphs


def test_cpu_training_matches_plain_module():
    a, b = _pair("cpu")
    batches = [_batch("cpu", seed=s) for s in range(3)]
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b))
    for ids, lengths in batches:
        for m, opt in ((a, opt_a), (b, opt_b)):
            _loss(m, ids, lengths).backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.gpu
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_graphed_training_matches_eager(set_to_none, accumulate):
    a, b = _pair("cuda")
    batches = [_batch("cuda", seed=s) for s in range(8)]
    la = _train(a, batches, set_to_none=set_to_none, accumulate=accumulate)
    lb = _train(b, batches, set_to_none=set_to_none, accumulate=accumulate)
    assert len(b.forward.graphs) == 1
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-4, atol=1e-5)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-4, atol=1e-5, msg=name)
    for (name, ba), bb in zip(a.named_buffers(), b.buffers(), strict=True):
        torch.testing.assert_close(bb.float(), ba.float(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_graphed_training_under_autocast():
    a, b = _pair("cuda")
    batches = [_batch("cuda", seed=s) for s in range(5)]
    la = _train(a, batches, autocast=True)
    lb = _train(b, batches, autocast=True)
    assert len(b.forward.graphs) == 1
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
def test_accumulated_grads_add_up():
    """A parameter's .grad must not be the graph's gradient buffer: the second backward would overwrite it
    before adding (2 x g2 instead of g1 + g2)."""
    a, b = _pair("cuda")
    b1, b2 = _batch("cuda", seed=1), _batch("cuda", seed=2)
    for m in (a, b):
        _loss(m, *b1).backward()
    for m in (a, b):
        _loss(m, *b2).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_second_forward_before_backward_runs_eagerly():
    a, b = _pair("cuda")
    b1, b2 = _batch("cuda", seed=1), _batch("cuda", seed=2)
    for m in (a, b):
        (_loss(m, *b1) + 0.5 * _loss(m, *b2)).backward()  # two forwards, one backward
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_new_shapes_eval_and_no_grad():
    a, b = _pair("cuda")
    for batch, seq in ((4, 16), (2, 16), (4, 8)):
        ids, lengths = _batch("cuda", batch=batch, seq=seq)
        torch.testing.assert_close(b(ids, lengths), a(ids, lengths), rtol=1e-4, atol=1e-5)
    assert len(b.forward.graphs) == 3
    a.eval()
    b.eval()
    with torch.no_grad():
        ids, lengths = _batch("cuda", seed=5)
        torch.testing.assert_close(b(ids, lengths), a(ids, lengths), rtol=1e-4, atol=1e-5)
    assert len(b.forward.graphs) == 3  # no_grad runs the original forward


@pytest.mark.gpu
def test_signatures_beyond_max_run_eagerly():
    torch.manual_seed(0)
    model = cuda_graphed(Tiny().cuda(), max_graphs=1)
    model(*_batch("cuda", seq=16))
    out = model(*_batch("cuda", seq=8))
    assert len(model.forward.graphs) == 1 and out.shape[1] == 8


@pytest.mark.gpu
def test_hooks_keep_the_module_eager():
    torch.manual_seed(0)
    model = Tiny().cuda()
    model.lin.register_forward_hook(lambda *_: None)
    cuda_graphed(model)
    with pytest.warns(RuntimeWarning, match="module lin has hooks"):
        model(*_batch("cuda"))
    assert not model.forward.graphs


class Syncs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 0:  # a host synchronisation: cannot be captured
            return self.lin(x)
        return -self.lin(x)


@pytest.mark.gpu
def test_uncapturable_forward_warns_and_stays_correct():
    torch.manual_seed(0)
    plain = Syncs().cuda()
    model = Syncs().cuda()
    model.load_state_dict(plain.state_dict())
    cuda_graphed(model)
    x = torch.randn(4, 8, device="cuda")
    stream = torch.cuda.current_stream()
    with pytest.warns(RuntimeWarning, match="capture failed"):
        out = model(x)
    # torch.cuda.graph leaves a failed capture's thread on its capture stream; the caller's is restored
    assert torch.cuda.current_stream() == stream
    torch.testing.assert_close(out, plain(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # warned once
    assert model.forward.disabled_reason is not None
    # the failed capture left the device's generator usable: random ops and dropout still run
    torch.randn(4, device="cuda")
    F.dropout(x, 0.5)


class CopiesANumber(nn.Module):
    """DeBERTa's make_log_bucket_position in small: a Python number copied to the GPU inside forward."""

    def __init__(self, rewritten: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.rewritten = rewritten

    def forward(self, x):
        if self.rewritten:  # what `opadvisor apply --rule sparse_launch --unsafe` writes for it
            three = torch.full((), 3, device=x.device).type_as(x)
        else:
            three = torch.tensor(3).type_as(x)
        return self.lin(x) * three


def _forbid_graph_bookkeeping(monkeypatch) -> None:
    """After a failed capture a call must not split its arguments or build a signature again."""

    def forbidden(*args, **kwargs):
        raise AssertionError("cuda_graphed did graph bookkeeping on a call after its capture failed")

    monkeypatch.setattr(graphs, "split_call", forbidden)
    monkeypatch.setattr(graphs, "_signature", forbidden)
    monkeypatch.setattr(graphs, "_eager_reason", forbidden)


@pytest.mark.gpu
def test_a_host_copy_fails_capture_once_and_then_costs_nothing(monkeypatch):
    """The capture stops at `torch.tensor(3).type_as(x)`: one warning that names the line, no second
    attempt, and every later call is the plain forward (nothing else per call), with eager's results."""
    torch.manual_seed(0)
    plain, model = CopiesANumber().cuda(), CopiesANumber().cuda()
    model.load_state_dict(plain.state_dict())
    cuda_graphed(model)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"capture failed .*test_kernels_graphs.py:\d+ in forward: "
                      r"three = torch.tensor\(3\).type_as\(x\)") as caught:  # fmt: skip
        model(x).sum().backward()
    assert len([w for w in caught if "cuda_graphed" in str(w.message)]) == 1
    assert model.forward.failed and model.forward.graphs == {}
    _forbid_graph_bookkeeping(monkeypatch)
    x2 = torch.randn(6, 8, device="cuda")  # another signature: not captured either
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for inp in (x, x2):
            torch.testing.assert_close(model(inp), plain(inp))
    torch.randn(4, device="cuda")  # the device's generator left usable


@pytest.mark.gpu
def test_the_rewritten_host_copy_captures():
    torch.manual_seed(0)
    plain, model = CopiesANumber(rewritten=True).cuda(), CopiesANumber(rewritten=True).cuda()
    model.load_state_dict(plain.state_dict())
    cuda_graphed(model)
    x = torch.randn(4, 8, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            out = model(x)
            out.sum().backward()
    assert not model.forward.failed and len(model.forward.graphs) == 1
    torch.testing.assert_close(out, plain(x))
    original = CopiesANumber().cuda()  # the form before the rewrite, eagerly: the same values
    original.load_state_dict(plain.state_dict())
    torch.testing.assert_close(out, original(x))


def test_after_a_failed_capture_a_call_is_the_plain_forward(monkeypatch):
    """CPU: once `failed` is set, a call goes straight to the original forward."""
    torch.manual_seed(0)
    model = cuda_graphed(CopiesANumber())
    x = torch.randn(4, 8)
    expected = model.forward.original(x)
    model.forward.failed = True
    _forbid_graph_bookkeeping(monkeypatch)
    torch.testing.assert_close(model(x), expected)


def _user_line_that_fails():
    return torch.zeros(4).view(3)  # raises inside torch


def test_blocking_frame_names_the_innermost_line_outside_torch():
    try:
        _user_line_that_fails()
    except RuntimeError as exc:
        where = graphs.blocking_frame(exc)
    line = next(
        i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "view(3)  # raises" in t
    )
    assert (
        where
        == f" at {__file__}:{line} in _user_line_that_fails: return torch.zeros(4).view(3)  # raises inside torch"
    )


def compiled_parity() -> None:
    torch.manual_seed(0)
    a = Tiny().cuda()
    b = Tiny().cuda()
    b.load_state_dict(a.state_dict())
    b = cuda_graphed(torch.compile(b))
    batches = [_batch("cuda", seed=s) for s in range(4)]
    la, lb = _train(a, batches), _train(b, batches)
    assert len(b.forward.graphs) == 1
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.slow
def test_graphs_over_a_compiled_module():
    """The order the codemod writes when a script compiles its model before building the optimizer:
    cuda_graphed(torch.compile(model)) captures the compiled forward and backward. In a fresh process, as a
    script runs (inductor compiles once per process and caches: a fresh process is what a user has)."""
    code = "import test_kernels_graphs as t; t.compiled_parity()"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=Path(__file__).parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# Library-style calls: keyword tensors, static arguments, dict-like outputs
# ---------------------------------------------------------------------------------------------------


class Output(OrderedDict):
    """Like HuggingFace's ModelOutput: an OrderedDict subclass whose keys are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


Pair = namedtuple("Pair", ["first", "second"])


def test_split_and_rebuild_a_keyword_call():
    ids, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
    args, kwargs = (ids,), {"return_dict": True, "attention_mask": mask, "labels": None, "scale": 1}
    tensors, layout = graphs.split_call(args, kwargs, cuda=False)
    assert tensors == (ids, mask)  # positional first, then keywords by name
    hash(layout)
    back_args, back_kwargs = graphs.rebuild_call(tensors, layout)
    assert back_args == args and back_kwargs == kwargs
    # static values (with their types) are part of the layout: another value is another graph
    assert graphs.split_call(args, {**kwargs, "return_dict": False}, cuda=False)[1] != layout
    assert graphs.split_call(args, {**kwargs, "scale": 1.0}, cuda=False)[1] != layout
    assert graphs.split_call(args, {**kwargs, "scale": True}, cuda=False)[1] != layout
    # keyword order does not matter
    assert graphs.split_call(args, dict(reversed(kwargs.items())), cuda=False)[1] == layout


@pytest.mark.parametrize(
    "args, reason",
    [
        (([torch.zeros(2)],), "argument 0 is a list holding tensors"),
        (({"a": 1},), "argument 0 is an unhashable dict"),
        ((3,), "a call without tensor arguments"),
    ],
)
def test_arguments_a_graph_cannot_take(args, reason):
    with pytest.raises(graphs.NotGraphable, match=reason):
        graphs.split_call(args, {}, cuda=False)
    with pytest.raises(graphs.NotGraphable, match="argument 0 is a cpu tensor"):
        graphs.split_call((torch.zeros(2),), {})


def test_outputs_flatten_and_rebuild():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    out = Output(loss=a, logits=b, extra=(c, None, Pair(a, 3)))
    tensors, spec = graphs.flatten_output(out)
    assert tensors == [a, b, c, a]
    new = [t + 10 for t in tensors]
    back = graphs.unflatten_output(new, spec)
    assert type(back) is Output and list(back) == ["loss", "logits", "extra"]
    assert back.loss is new[0] and back["logits"] is new[1]
    assert back.extra[0] is new[2] and back.extra[1] is None
    assert isinstance(back.extra[2], Pair) and back.extra[2].first is new[3] and back.extra[2].second == 3
    assert out.loss is a  # the captured output is left alone
    assert graphs.unflatten_output([b], graphs.flatten_output(a)[1]) is b
    with pytest.raises(graphs.NotGraphable, match="the output holds a object"):
        graphs.flatten_output((a, object()))


def test_cpu_calls_run_eagerly_and_warn_once():
    torch.manual_seed(0)
    model = cuda_graphed(Tiny())
    ids, lengths = _batch("cpu")
    with pytest.warns(RuntimeWarning, match="argument 0 is a cpu tensor"):
        model(ids, lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, lengths)  # once per reason
    assert not model.forward.graphs


class KeywordModel(nn.Module):
    """A library-style forward: keyword tensors, a static flag, a dict-like output with the loss."""

    def __init__(self, vocab=50, hidden=32):
        super().__init__()
        self.body = Tiny(vocab, hidden)

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=True):
        lengths = attention_mask.sum(-1) if attention_mask is not None else None
        logits = self.body(input_ids, lengths)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return Output(loss=loss, logits=logits) if loss is not None else Output(logits=logits)


def _keyword_batch(seed):
    ids, lengths = _batch("cuda", seed=seed)
    mask = (torch.arange(ids.shape[1], device="cuda")[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.gpu
def test_keyword_calls_with_dict_outputs_match_eager():
    torch.manual_seed(0)
    a, b = KeywordModel().cuda(), KeywordModel().cuda()
    b.load_state_dict(a.state_dict())
    cuda_graphed(b)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback on the way
        for step in range(4):
            batch = _keyword_batch(step)
            outs = []
            for m, opt in zip((a, b), opts, strict=True):
                out = m(**batch)
                out.loss.backward()
                opt.step()
                opt.zero_grad()
                outs.append(out)
            assert type(outs[1]) is Output and list(outs[1]) == ["loss", "logits"]
            torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-5)
    assert len(b.forward.graphs) == 1
    # another static value is another signature: a graph of its own, a tuple output
    loss, logits = b(**_keyword_batch(5), return_dict=False)
    assert len(b.forward.graphs) == 2 and isinstance(logits, torch.Tensor)
    torch.testing.assert_close(loss, a(**_keyword_batch(5)).loss, rtol=1e-4, atol=1e-5)


class CacheOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), object()  # e.g. a cache object: cannot be rebuilt around replayed tensors


@pytest.mark.gpu
def test_output_a_graph_cannot_rebuild_warns_and_stays_eager():
    model = cuda_graphed(CacheOutput().cuda())
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with pytest.warns(RuntimeWarning, match="the output holds a object"):
        y, _ = model(x)
    y.sum().backward()
    assert not model.forward.graphs and x.grad is not None


class AllocatesWhileCaptured(Tiny):
    """Makes reference cycles while it is captured, the allocations that make Python's collector run."""

    def forward(self, ids, lengths):
        if torch.cuda.is_current_stream_capturing():
            for _ in range(2000):
                cycle: list = []
                cycle.append(cycle)
        return super().forward(ids, lengths)


@pytest.mark.gpu
def test_no_garbage_collection_runs_during_a_capture():
    """Graphed modules sit in reference cycles (module -> forward -> module), so after a test (or a training
    run) ends they wait for the collector, with their graphs and memory pools. A collection inside a later
    capture frees them there, and on the H200 the GPU suite's capture failed so ("operation failed due to a
    previous error during capture") after earlier tests, never alone: the capture must not depend on what
    earlier code left. cuda_graphed collects before capturing and lets no collection start inside it, even
    with the collector's threshold at its lowest and the forward making cycles."""
    for seed in range(2):
        old = cuda_graphed(Tiny().cuda())
        _loss(old, *_batch("cuda", seed=seed)).backward()
        assert len(old.forward.graphs) == 1
        del old  # garbage now, but in a cycle: not freed until the collector runs
    torch.manual_seed(0)
    plain, model = AllocatesWhileCaptured().cuda(), AllocatesWhileCaptured().cuda()
    model.load_state_dict(plain.state_dict())
    cuda_graphed(model)
    batches = [_batch("cuda", seed=s) for s in range(3)]
    during_capture: list[str] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during_capture.append(f"generation {info['generation']}")

    threshold = gc.get_threshold()
    gc.callbacks.append(seen)
    gc.set_threshold(1, 1, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
            losses = _train(model, batches)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(seen)
    assert during_capture == []
    assert gc.isenabled()
    assert model.forward.disabled_reason is None and len(model.forward.graphs) == 1
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(_train(plain, batches)), rtol=1e-4, atol=1e-5
    )


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


@pytest.mark.gpu
def test_huggingface_model_called_with_keywords():
    """transformers' BertForMaskedLM (a tiny configuration, no dropout) called as `model(**batch)`: the
    graphed module returns a MaskedLMOutput and trains as the eager one does."""
    torch.manual_seed(0)
    a = _tiny_bert().cuda()
    b = _tiny_bert().cuda()
    b.load_state_dict(a.state_dict())
    cuda_graphed(b)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (4, 16), generator=g).cuda()
        mask = torch.ones_like(ids)
        mask[:, 12:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
        losses = []
        for m, opt in zip((a, b), opts, strict=True):
            out = m(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.detach())
        assert type(out).__name__ == "MaskedLMOutput"
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    assert b.forward.disabled_reason is None and len(b.forward.graphs) == 1


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def test_a_cache_output_is_refused_and_use_cache_false_is_only_added_where_it_may_be():
    class LM(nn.Module):
        def forward(self, input_ids, labels=None, use_cache=None):
            return input_ids

    forward = LM().forward
    _, layout = graphs.split_call((), {"input_ids": torch.ones(2), "labels": torch.ones(2)}, cuda=False)
    n_args, names, slots = graphs._layout_without_cache(forward, layout)
    args, kwargs = graphs.rebuild_call((torch.ones(2), torch.zeros(2)), (n_args, names, slots))
    assert args == () and kwargs["use_cache"] is False and set(kwargs) == {"input_ids", "labels", "use_cache"}
    _, asked = graphs.split_call((), {"input_ids": torch.ones(2), "use_cache": True}, cuda=False)
    assert graphs._layout_without_cache(forward, asked) is None  # the caller chose: respected
    _, positional = graphs.split_call((torch.ones(2), None, True), {}, cuda=False)
    assert graphs._layout_without_cache(forward, positional) is None
    assert graphs._layout_without_cache(lambda input_ids: input_ids, layout) is None
    patched = LM()  # a forward replaced on the instance by a (*args, **kwargs) wrapper: read the class's
    patched.forward = types.MethodType(
        lambda self, *args, **kwargs: LM.forward(self, *args, **kwargs), patched
    )
    assert graphs._layout_without_cache(patched.forward, layout) == (n_args, names, slots)


@pytest.mark.gpu
def test_a_causal_lm_training_with_its_default_cache_is_graphed_without_it():
    """GPT-2 called as `model(**batch)` while training fills a DynamicCache (use_cache defaults to True),
    which a graph cannot return: it is captured with use_cache=False (one warning) and trains as the
    eager model does."""
    torch.manual_seed(0)
    a = _tiny_gpt2().cuda()
    b = _tiny_gpt2().cuda()
    b.load_state_dict(a.state_dict())
    cuda_graphed(b)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    with pytest.warns(RuntimeWarning, match=r"graphed with use_cache=False: the output holds a DynamicCache"):
        for step in range(3):
            ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step)).cuda()
            losses = []
            for m, opt in zip((a, b), opts, strict=True):
                out = m(input_ids=ids, labels=ids)
                out.loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(out.loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    assert {"past_key_values", "cache"}.isdisjoint(out.keys())  # no cache returned (5.24 renamed the field)
    assert b.forward.disabled_reason is None and len(b.forward.graphs) == 1


# ---------------------------------------------------------------------------------------------------
# Compiled regions inside a graphed forward (compile_blocks under cuda_graphed)
# ---------------------------------------------------------------------------------------------------


class MaskedBlock(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    @compile_region
    def forward(self, x, mask=None):
        h = F.gelu(self.lin(x))
        return x + (h if mask is None else h + mask)


class CaptureAware(nn.Module):
    """Like transformers' BERT: the model passes its blocks a mask only while a CUDA graph is being captured
    (its `if mask.all()` shortcut is skipped under capture), so the blocks meet another argument layout in
    the capture than in the warm-up passes before it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MaskedBlock(), MaskedBlock()])

    def forward(self, x):
        capturing = torch.cuda.is_current_stream_capturing()
        mask = torch.zeros_like(x[..., :1]) if capturing else None
        for block in self.blocks:
            x = block(x, mask)
        return x


@pytest.mark.gpu
@pytest.mark.slow
def test_compiled_blocks_compile_outside_the_capture_and_run_compiled_in_the_graph(monkeypatch):
    from opadvisor.kernels import region

    compiled_after_capture = []
    compile_missed = region.compile_missed
    monkeypatch.setattr(region, "compile_missed", lambda m: compiled_after_capture.extend(compile_missed(m)))
    torch.manual_seed(0)
    plain = CaptureAware().cuda()
    graphed = CaptureAware().cuda()
    graphed.load_state_dict(plain.state_dict())
    graphed = cuda_graphed(graphed)
    x = torch.randn(8, 32, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no eager fallback, no block left uncompiled
        for _ in range(3):
            for model in (plain, graphed):
                model.zero_grad(set_to_none=True)
                model(x).square().sum().backward()
    assert compiled_after_capture == [MaskedBlock.forward.__wrapped__.__qualname__]
    assert len(graphed.forward.graphs) == 1 and region.take_capture_misses() == []
    assert region_state(MaskedBlock.forward) == ("compiled", None)
    torch.testing.assert_close(graphed(x), plain(x))
    for p, q in zip(plain.parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)

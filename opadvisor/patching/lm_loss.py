"""The LM heads' losses: BertForMaskedLM's (and DebertaV2ForMaskedLM's) masked-LM loss (hf_mlm_loss) and the
causal-LM loss of GPT2LMHeadModel and the Llama family (hf_causal_lm_loss) as `opadvisor.kernels.cross_entropy`
over the 16-bit logits; with unsafe=True, their LM head and its loss as one `opadvisor.kernels.linear_cross_entropy`
(hf_linear_cross_entropy: the logits never whole)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from opadvisor.libraries import deberta_v2_class, llama_family_classes

from .arguments import _arguments, _named_parameters
from .fingerprint import _fingerprint_problem
from .shared import _no_hooks, _qualified, _State, _types


# -- LM heads' loss (BertForMaskedLM, GPT2LMHeadModel) -------------------------------------------------------
# The model's forward runs as written with labels=None (it returns the logits and computes no loss); the loss
# it would have computed from those logits is then computed by opadvisor.kernels.cross_entropy, which reads
# the 16-bit logits in place (a column slice of a padded LM head included) instead of eager's float32 copies.
def _check_bert_mlm(module: nn.Module) -> str | None:
    cls = type(module)
    deberta = _qualified(cls) == deberta_v2_class("DebertaV2ForMaskedLM")  # BERT's loss on DeBERTa's logits
    key = "DebertaV2ForMaskedLM.forward" if deberta else "BertForMaskedLM.forward"
    return _fingerprint_problem(cls, key, cls.forward, None) or _no_hooks(module)


_LLAMA_CAUSAL_LM = frozenset(llama_family_classes("ForCausalLM"))


def _causal_lm_forward_problem(cls: type) -> str | None:
    """Whether the class's forward is the GPT-2 or Llama-family causal-LM forward the patches reproduce."""
    if _qualified(cls) in _LLAMA_CAUSAL_LM:
        prefix = cls.__name__[: -len("ForCausalLM")]
        return _fingerprint_problem(cls, "LlamaForCausalLM.forward", cls.forward, prefix)
    return _fingerprint_problem(cls, "GPT2LMHeadModel.forward", cls.forward, None)


def _check_causal_lm(module: nn.Module) -> str | None:
    cls = type(module)
    problem = _causal_lm_forward_problem(cls)
    if problem is None and "_loss_function" in module.__dict__:
        return "its loss_function was replaced (the patch reproduces transformers' ForCausalLMLoss)"
    if problem is None:
        loss = getattr(module, "loss_function", None)
        if getattr(loss, "__name__", None) != "ForCausalLMLoss":
            return f"its loss_function is {getattr(loss, '__name__', loss)!r}, not ForCausalLMLoss"
        fixed = getattr(sys.modules.get(loss.__module__), "fixed_cross_entropy", None)
        problem = _fingerprint_problem(cls, "ForCausalLMLoss", loss, None) or _fingerprint_problem(
            cls, "fixed_cross_entropy", fixed, None
        )
    return problem or _no_hooks(module)


def _labels_out(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
    """(args, kwargs with labels=None, labels): the call without its labels, wherever they were passed."""
    names = _named_parameters(type(module).forward)[1:]  # without self
    index = names.index("labels")
    if len(args) > index:
        return (*args[:index], None, *args[index + 1 :]), kwargs, args[index]
    return args, {**kwargs, "labels": None}, kwargs.get("labels")


def _with_loss(out: Any, loss: torch.Tensor) -> Any:
    """The model's output (computed without labels) with the loss in front, as the original returns it."""
    if isinstance(out, tuple):  # return_dict=False: the loss is the first element
        return (loss, *out)
    return type(out)(loss=loss, **out)


def _bert_mlm(module: nn.Module, state: _State, *args, **kwargs):
    args, kwargs, labels = _labels_out(module, args, kwargs)
    out = state.original(*args, **kwargs)
    if labels is None:
        return out
    from opadvisor.kernels import cross_entropy  # looked up at call time, as bias_dropout_add

    logits = out[0]
    loss = cross_entropy(logits.view(-1, module.config.vocab_size), labels.view(-1))
    return _with_loss(out, loss)


# -- BertForMaskedLM's decoder and its loss as one kernel (hf_mlm_linear_cross_entropy, unsafe) ----------------
def _check_mlm_linear_cross_entropy(module: nn.Module) -> str | None:
    problem = _check_bert_mlm(module)
    head = getattr(module, "cls", None)
    predictions = getattr(head, "predictions", None)
    decoder = getattr(predictions, "decoder", None)
    problem = problem or _types(predictions, {"decoder": nn.Linear})
    if problem is None and decoder.bias is None:
        problem = "its MLM decoder has no bias"
    for part, name in ((head, "BertOnlyMLMHead"), (predictions, "BertLMPredictionHead")):
        if problem is None and type(part).forward is not _original_forward(part, name):
            problem = f"its {type(part).__name__}'s forward is not transformers' {name}.forward"
    parts = (head, predictions, predictions.transform, module.bert) if problem is None else ()
    return problem or _no_hooks(*parts)


def _original_forward(module: nn.Module, name: str) -> Any:
    """The forward of the class `name` of the module's own transformers module (None where it has none)."""
    cls = getattr(sys.modules[type(module).__module__], name, None)
    return getattr(cls, "forward", None)


def _mlm_linear_cross_entropy(module: nn.Module, state: _State, *args, **kwargs):
    """In training with labels: the encoder and the head's transform, then the decoder + loss fused, logits None;
    otherwise the original forward."""
    from opadvisor.kernels import linear_cross_entropy

    arguments = _arguments(module, args, kwargs)
    labels = arguments.pop("labels", None)
    if labels is None or not (module.training and torch.is_grad_enabled()):
        return state.original(*args, **kwargs)
    return_dict = arguments.pop("return_dict", None)
    input_ids = arguments.pop("input_ids", None)
    outputs = module.bert(input_ids, **arguments, return_dict=True)
    predictions = module.cls.predictions
    hidden = predictions.transform(outputs[0])
    decoder = predictions.decoder
    loss = linear_cross_entropy(hidden, decoder.weight, labels.to(hidden.device), bias=decoder.bias)
    output_cls = sys.modules[type(module).__module__].MaskedLMOutput
    out = output_cls(
        loss=loss, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions
    )
    return _as_returned(module, out, return_dict)


def _as_returned(module: nn.Module, out: Any, return_dict: bool | None) -> Any:
    """A replacement forward's output object as the original returns it: itself, or a tuple where
    return_dict is False (or the config's return_dict is, where the call did not say)."""
    if return_dict is None:
        return_dict = getattr(module.config, "return_dict", True)
    return out if return_dict else out.to_tuple()


def _causal_lm(module: nn.Module, state: _State, *args, **kwargs):
    args, kwargs, labels = _labels_out(module, args, kwargs)
    out = state.original(*args, **kwargs)
    if labels is None:
        return out
    named = _named_parameters(type(module).forward)
    extra = {k: v for k, v in kwargs.items() if k not in named}  # what the forward hands its loss_function
    return _with_loss(out, _causal_lm_loss(out[0], labels, module.config.vocab_size, **extra))


def _causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss (labels shifted left, -100 ignored, a sum over num_items_in_batch when
    given) without its float32 copy of the logits: the kernel computes in float32 from the 16-bit values."""
    from opadvisor.kernels import cross_entropy

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    target = shift_labels.reshape(-1).to(logits.device)
    loss = cross_entropy(logits.view(-1, vocab_size), target, ignore_index=ignore_index, reduction=reduction)
    loss = loss.float()  # the original computes on logits.float(): its loss is float32
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


# -- GPT-2's and the Llama family's LM head and its loss as one kernel (hf_linear_cross_entropy, unsafe) -------
# The decoder under the LM head (GPT-2's `transformer`, the Llama family's `model`) and the output class its
# forward returns, by the LM class's name
_BODIES = {"GPT2LMHeadModel": ("transformer", "CausalLMOutputWithCrossAttentions")}
_LLAMA_BODY = ("model", "CausalLMOutputWithPast")


def _body(module: nn.Module) -> nn.Module | None:
    return getattr(module, _BODIES.get(type(module).__name__, _LLAMA_BODY)[0], None)


def _output_class(module: nn.Module) -> type:
    name = _BODIES.get(type(module).__name__, _LLAMA_BODY)[1]
    return getattr(sys.modules[type(module).__module__], name)


def _check_linear_cross_entropy(module: nn.Module) -> str | None:
    problem = _check_causal_lm(module)
    head = getattr(module, "lm_head", None)
    if problem is None and type(head) is not nn.Linear:
        problem = f"its lm_head is a {type(head).__name__}, not nn.Linear (wrapped or replaced)"
    if problem is None and head.bias is not None:
        problem = "its lm_head has a bias"
    if problem is None and getattr(module.config, "final_logit_softcapping", None):
        problem = "its logits are soft-capped (final_logit_softcapping)"
    return problem or _no_hooks(head, _body(module))


def _linear_cross_entropy(module: nn.Module, state: _State, *args, **kwargs):
    """In training with labels (logits_to_keep 0): the decoder, then the fused head + loss, logits None;
    otherwise the original forward."""
    arguments = _arguments(module, args, kwargs)
    labels = arguments.pop("labels", None)
    keep = arguments.pop("logits_to_keep", 0)
    training = module.training and torch.is_grad_enabled()
    if labels is None or not training or not (isinstance(keep, int) and keep == 0):
        return state.original(*args, **kwargs)
    return_dict = arguments.pop("return_dict", None)
    named = _named_parameters(type(module).forward)
    extra = {k: v for k, v in arguments.items() if k not in named}  # what the forward hands its loss_function
    outputs = _body(module)(**arguments)
    loss = _fused_causal_lm_loss(outputs.last_hidden_state, module.lm_head.weight, labels, **extra)
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    out = _output_class(module)(loss=loss, logits=None, **rest)
    return _as_returned(module, out, return_dict)


def _fused_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss over lm_head(hidden) (see `_causal_lm_loss`), the logits never whole."""
    from opadvisor.kernels import linear_cross_entropy

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(hidden, weight, shift_labels.to(hidden.device), ignore_index, reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss

"""`PatchReport`: what `opadvisor.patch` did to one model, and the text it prints (modules patched and left,
grouped by class and fix)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PatchReport:
    """What `patch` did to one model: modules patched (path, class, fix) and left (path, class, why)."""

    model: str
    patched: list[tuple[str, str, str]] = field(default_factory=list)
    left: list[tuple[str, str, str]] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        if self.patched:
            groups = _grouped((fix, cls) for _, cls, fix in self.patched)
            paths = _grouped(((fix, cls), path) for path, cls, fix in self.patched)
            out.append(
                f"opadvisor.patch: {self.model}: patched {len(self.patched)} modules: "
                + "; ".join(
                    f"{_short(cls)} x{n} ({fix}: {_paths(paths[(fix, cls)])})"
                    for (fix, cls), n in groups.items()
                )
            )
        for (cls, reason), n in _grouped((cls, reason) for _, cls, reason in self.left).items():
            out.append(f"opadvisor.patch: {self.model}: left {_short(cls)} x{n}: {reason}")
        if not self.patched and not self.left:
            out.append(
                f"opadvisor.patch: nothing to patch in {self.model}: none of its modules is one opadvisor knows "
                f"({_known()}); the model runs as it was"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _grouped(items: Iterable[Any]) -> dict[Any, Any]:
    """Count equal items (insertion order); for pairs (key, value) collect the values per key instead."""
    out: dict[Any, Any] = {}
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple):
            out.setdefault(item[0], []).append(item[1])
        else:
            out[item] = out.get(item, 0) + 1
    return out


def _paths(paths: list[str]) -> str:
    import re

    starred = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", p) or "<model>" for p in paths})
    return ", ".join(starred[:3]) + (", ..." if len(starred) > 3 else "")


def _short(cls: str) -> str:
    return cls.rsplit(".", 1)[-1]


def _known() -> str:
    return (
        "it patches transformers' BERT-family attention and output blocks (BERT, RoBERTa, XLM-R, ELECTRA, "
        "...), GPT-2's attention and tanh GELU, BertForMaskedLM's and GPT2LMHeadModel's loss, the Llama "
        "family's (Llama, Mistral, Qwen2/3) RMSNorm, SwiGLU MLP and causal-LM loss, DeBERTa-v2/v3's "
        "disentangled attention, relative positions, output blocks and masked-LM loss, "
        "nn.MultiheadAttention, nn.TransformerEncoderLayer, and nn.Linear layers with sizes that are not "
        "multiples of 8; asked by name, compile_blocks compiles the model's repeated library blocks"
    )

"""`PaddedLinear`: an `nn.Linear` whose matrix product runs on sizes padded to a multiple of 8.

A 16-bit GEMM whose N (out_features) or K (in_features) is not a multiple of 8 misses the aligned
tensor-core kernels (a 30522-wide LM head ran 2.5x slower than 30528 on an H200). Padding the weight with
zero rows (N) or zero columns (K, and x with zero columns) and slicing the output computes exactly the
same numbers: the padded rows produce columns that are cut off, the padded columns multiply zeros.

Design, correctness first: the parameters keep the original shapes ([out, in] and [out]). The padding is
done in `forward`, on the fly, through differentiable `F.pad`, so
- `state_dict`, `load_state_dict`, `in_features` / `out_features`, `repr`, weight tying (an LM head
  sharing the embedding matrix) and every `isinstance(m, nn.Linear)` check behave as for `nn.Linear`
  (it is a subclass, and `__init__` is nn.Linear's: the same RNG draws, so a rewritten script starts from
  identical weights);
- the optimizer only ever sees the original parameters: no padding rows to keep at zero, no weight decay
  or momentum on them, no extra optimizer state.
The cost is a copy of the weight (N x K, small next to the GEMM) each forward, and for K padding a copy
of x; the output is a view of the padded result ([..., :out_features], row stride padded).

Padding happens only on CUDA tensors (on the CPU alignment does not matter) and only when a size is
misaligned; otherwise it is exactly `F.linear`. The dispatch record (`opadvisor.kernels.dispatch_counts()`)
counts `padded_linear` calls as "kernel" (padded), "chain" (aligned already: `F.linear`) or "reference"
(`PaddedLinear` on a CPU tensor: `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _dispatch

OP = "padded_linear"  # its name in the dispatch record: "kernel" = the padded product ran


def padded_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, multiple: int = 8
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed with out/in features padded to `multiple`; same result."""
    out_features, in_features = weight.shape
    pad_out = -out_features % multiple
    pad_in = -in_features % multiple
    if pad_out == 0 and pad_in == 0:
        _dispatch.record(OP, _dispatch.CHAIN)
        return F.linear(x, weight, bias)
    _dispatch.record(OP, _dispatch.KERNEL)
    w = F.pad(weight, (0, pad_in, 0, pad_out))
    if pad_in:
        x = F.pad(x, (0, pad_in))
    b = F.pad(bias, (0, pad_out)) if bias is not None and pad_out else bias
    y = F.linear(x, w, b)
    return y[..., :out_features] if pad_out else y


def should_pad(x: torch.Tensor) -> bool:
    """Whether `PaddedLinear` pads for this input: only on CUDA, where alignment picks the GEMM kernel."""
    return x.device.type == "cuda"


class PaddedLinear(nn.Linear):
    """`nn.Linear(in_features, out_features, bias, device, dtype)` computed on padded sizes.

    `multiple`: the size to pad to (8 suits bf16/fp16 tensor cores; 64 where that measures faster).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        multiple: int = 8,
    ) -> None:
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.multiple = multiple

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not should_pad(input):
            _dispatch.record(OP, _dispatch.REFERENCE)
            return F.linear(input, self.weight, self.bias)
        return padded_linear(input, self.weight, self.bias, multiple=self.multiple)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, multiple={self.multiple}"

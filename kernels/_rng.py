"""Dropout randomness: the seed each call draws, and the keep mask that the kernels compute from it.

The kernels never store a dropout mask: they recompute it from (seed, element position) with Philox4x32-10
(the counter-based generator of cuRAND and of Triton's `tl.randint4x`), forward and backward alike.

The stream, per element at (row, col) of the 2-D row view of the tensor:
    words = Philox4x32-10(key = (k0, k1), counter = (col // 4, row % 2**32, row // 2**32, stream))
    keep  = (words[col % 4] >> 1) >= threshold,   threshold = round(p * 2**31)
so one Philox call serves four neighbouring columns, and the mask does not depend on block sizes or on
how rows are split among programs. `philox_keep_mask` below computes the same bits with PyTorch integer
ops: it is the oracle that the kernels' masks are tested against, bit for bit.

Seeds follow `torch.manual_seed`. For CUDA tensors the key is the device generator's seed and the stream
its Philox offset, which each call advances by 4 (as PyTorch's own dropout advances it): no kernel runs
and nothing synchronises. For CPU tensors one 62-bit value is drawn from the default CPU generator.

While a CUDA graph is being captured, a seed read on the host would be frozen into the graph (every replay
would repeat the mask). There the seed is drawn on the device instead: three int32 words from
`torch.randint`, which PyTorch's generator advances on every replay, and the kernels load them through a
pointer (`SEED_PTR`). The backward reads the same three words, saved with the forward's tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from ._backend import cuda_graph_capturing

_M32 = 0xFFFFFFFF
_M31 = 0x7FFFFFFF
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10


Seed = tuple[int, int, int] | torch.Tensor


def draw_seed(device: torch.device) -> Seed:
    """(k0, k1, stream) for one dropout call, each in [0, 2**31) so kernel arguments keep one type; an
    int32 device tensor holding the three words while the current CUDA stream is being captured."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.randint(0, _M31, (3,), dtype=torch.int32, device=device)
    return draw_host_seed(device)


def draw_op_seed(device: torch.device, op: str) -> Seed:
    """`draw_seed` for the custom ops, whose seed travels as a CPU tensor: refused while a CUDA graph
    is being captured, where it would be frozen (torch.compile's default path traces the plain chains)."""
    if device.type == "cuda" and cuda_graph_capturing():
        raise RuntimeError(
            f"{op} with dropout cannot be captured in a CUDA graph (its seed would repeat at every replay); "
            "keep the kernels' COMPILE_PATH at its default, or call the op outside torch.compile"
        )
    return draw_seed(device)


def draw_host_seed(device: torch.device) -> tuple[int, int, int]:
    """`draw_seed` as host integers (right only when no CUDA graph is being captured)."""
    if device.type == "cuda" and hasattr(torch.Generator, "get_offset"):  # torch >= 2.1
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        seed = gen.initial_seed()
        offset = gen.get_offset()
        gen.set_offset(offset + 4)
        return seed & _M31, (seed >> 31) & _M31, (offset // 4) & _M31
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())  # the CPU generator: no sync
    return seed & _M31, (seed >> 31) & _M31, 0


@contextlib.contextmanager
def fixed_dropout_seed(seed: tuple[int, int, int] = (1, 2, 3)) -> Iterator[None]:
    """Every dropout of these kernels inside the block uses `seed` (k0, k1, stream), so every call draws
    the same mask and no seed is drawn: for timing replays of a CUDA graph and for debugging, never for
    training (its masks must differ from call to call)."""
    global draw_seed
    if len(seed) != 3 or not all(isinstance(v, int) and 0 <= v <= _M31 for v in seed):
        raise ValueError(f"a dropout seed is three integers in [0, 2**31), not {seed!r}")
    drawn = draw_seed
    draw_seed = lambda device: seed  # noqa: E731 - the kernels call _rng.draw_seed: rebinding reaches them
    try:
        yield
    finally:
        draw_seed = drawn


def seed_launch_args(seed: Seed, placeholder: torch.Tensor) -> tuple[torch.Tensor, int, int, int, bool]:
    """(SEED pointer, k0, k1, stream, SEED_PTR): the kernels' seed arguments for either kind of seed.

    `placeholder` fills the pointer slot when the seed travels as integers (the kernel never reads it)."""
    if isinstance(seed, torch.Tensor):
        return seed, 0, 0, 0, True
    k0, k1, stream = seed
    return placeholder, k0, k1, stream, False


def seed_args(seed: Seed, placeholder: torch.Tensor) -> tuple:
    """(k0, k1, stream, SEED pointer): the dropout kernels' seed arguments for either kind of seed (the
    kernels' SEED_PTR constexpr says which they read). `placeholder` fills the pointer slot when the seed
    travels as integers (the kernel never reads it)."""
    if isinstance(seed, torch.Tensor):
        return 0, 0, 0, seed
    return (*seed, placeholder)


def host_seed(seed: Seed) -> tuple[int, int, int]:
    """The three integers of `seed` (reads a device seed back: a sync; for tests and oracles)."""
    if isinstance(seed, torch.Tensor):
        k0, k1, stream = (int(v) for v in seed.tolist())
        return k0, k1, stream
    return seed


@functools.lru_cache(maxsize=256)
def dropout_scalars(p: float) -> tuple[float, int]:
    """(keep_scale(p), threshold(p)), the kernels' dropout arguments, cached: one lookup per launch."""
    return keep_scale(p), threshold(p)


def threshold(p: float) -> int:
    """Integer threshold on the 31 random bits: an element is kept when bits >= threshold."""
    return min(int(round(p * 2**31)), _M31)


def keep_scale(p: float) -> float:
    """The factor kept elements are multiplied by (0 when everything is dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b for a, b < 2**32, in int64 without overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_prod = a_lo * b
    t = a_hi * b + (lo_prod >> 16)
    return t >> 16, ((t & 0xFFFF) << 16) | (lo_prod & 0xFFFF)


def philox4x32(c0, c1, c2, c3, k0: int, k1: int) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors holding uint32 values (the same rounds as Triton's philox_impl)."""
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul32(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mul32(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_keep_mask(
    seed: tuple[int, int, int],
    n_rows: int,
    n_cols: int,
    p: float,
    device: torch.device | str = "cpu",
    first_row: int = 0,
) -> torch.Tensor:
    """The keep mask (bool) the kernels use for `seed` and dropout probability `p`, for rows
    first_row .. first_row + n_rows - 1 and columns 0 .. n_cols - 1."""
    k0, k1, stream = seed
    rows = torch.arange(first_row, first_row + n_rows, dtype=torch.int64, device=device)[:, None]
    quads = torch.arange((n_cols + 3) // 4, dtype=torch.int64, device=device)[None, :]
    shape = (n_rows, quads.shape[1])
    c0 = quads.expand(shape)
    c1 = (rows & _M32).expand(shape)
    c2 = (rows >> 32).expand(shape)
    c3 = torch.full(shape, stream, dtype=torch.int64, device=device)
    words = torch.stack(philox4x32(c0, c1, c2, c3, k0, k1), dim=-1).reshape(n_rows, -1)[:, :n_cols]
    return (words >> 1) >= threshold(p)

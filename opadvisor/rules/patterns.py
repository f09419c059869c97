"""Pattern declarations: each pattern's steps, declared once, read by the profile and the source matchers.

The profile side (`rules/_attention.py`, `rules/_regions.py`) binds a step to the ops it ran; the source
side (`rewrite/_chain.py`, `rewrite/fuse_region.py`) binds it to the expression that wrote it. Both read
the names, order, optional steps and swaps from here, so the two stages cannot disagree on what a pattern
is. What one side needs beyond the pattern (the ops a step runs as, the source's casts and temporaries)
stays a property of that side's matcher.

The attention chain, in application order (every step but the softmax optional):

    qk -> scale -> mask -> softmax -> zero -> dropout -> pv

Zeroing the masked probabilities and dropout commute (a dropped position and a masked one are both 0,
the kept ones are scaled alike), so code writes them in either order, and `masked_softmax`'s
`zero_masked=True, dropout_p=p` computes both orders: the declaration lets them swap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ATTENTION",
    "BIAS",
    "DROPOUT_ADD",
    "DROPOUT",
    "FUSED_SOFTMAX",
    "GELU_ERF",
    "GELU_TANH",
    "MASK",
    "PV",
    "QK",
    "REGION_CHAINS",
    "RELPOS_GATHER",
    "RESIDUAL",
    "SCALE",
    "SIGMOID_GATE",
    "SILU",
    "SOFTMAX",
    "ZERO",
    "Pattern",
    "RegionChain",
    "Step",
]

# the attention chain's steps (the labels findings, facts and both matchers use)
QK = "qk"
SCALE = "scale"
MASK = "mask"
SOFTMAX = "softmax"
ZERO = "zero"
DROPOUT = "dropout"
PV = "pv"


@dataclass(frozen=True)
class Step:
    """One step of a pattern."""

    name: str
    optional: bool = True
    # written as arithmetic (`x / c`, `x + m`), which the source alone cannot tell from other arithmetic
    # (a per-head tensor, a position bias): the source matcher folds it only where the profile saw it
    arithmetic: bool = False


@dataclass(frozen=True)
class Pattern:
    """Steps in application order around one `anchor` step; `swaps`: pairs of adjacent steps that may
    also run in the other order."""

    name: str
    steps: tuple[Step, ...]
    anchor: str
    swaps: tuple[frozenset[str], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps)

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    def only(self, *names: str) -> Pattern:
        """The pattern restricted to these steps (a rule's view of it: fused_softmax has no products)."""
        keep = set(names) | {self.anchor}
        return Pattern(
            self.name,
            tuple(s for s in self.steps if s.name in keep),
            self.anchor,
            tuple(pair for pair in self.swaps if pair <= keep),
        )

    def before(self) -> tuple[str, ...]:
        """The steps applied before the anchor, in application order."""
        return self.names[: self.names.index(self.anchor)]

    def after(self) -> tuple[str, ...]:
        """The steps applied after the anchor, in application order."""
        return self.names[self.names.index(self.anchor) + 1 :]

    def arithmetic(self) -> frozenset[str]:
        return frozenset(s.name for s in self.steps if s.arithmetic)

    def may_follow(self, earlier: str, later: str) -> bool:
        """Whether step `later` may be applied after step `earlier`."""
        names = self.names
        return names.index(earlier) < names.index(later) or frozenset({earlier, later}) in self.swaps

    def next_after(self, done: Sequence[str]) -> tuple[str, ...]:
        """The steps after the anchor that may come next once `done` (steps after it) were applied."""
        return tuple(n for n in self.after() if n not in done and all(self.may_follow(d, n) for d in done))

    def orders(self) -> list[tuple[str, ...]]:
        """The step orders the pattern accepts: the declared one, then each with one pair swapped."""
        out = [self.names]
        for pair in self.swaps:
            a, b = sorted(pair, key=self.names.index)
            order = list(self.names)
            i, j = order.index(a), order.index(b)
            order[i], order[j] = b, a
            out.append(tuple(order))
        return out


ATTENTION = Pattern(
    "attention",
    (
        Step(QK),
        Step(SCALE, arithmetic=True),
        Step(MASK, arithmetic=True),
        Step(SOFTMAX, optional=False),
        Step(ZERO),
        Step(DROPOUT),
        Step(PV),
    ),
    anchor=SOFTMAX,
    swaps=(frozenset({ZERO, DROPOUT}),),
)
# fused_softmax's view of it (the rule's facts and the source matcher's steps): no matrix products
FUSED_SOFTMAX = ATTENTION.only(SCALE, MASK, ZERO, DROPOUT)


# a dropout and the residual add after it, the dropout's input maybe a bias add (fused_dropout_add)
BIAS = "bias"
RESIDUAL = "residual"
DROPOUT_ADD = Pattern(
    "dropout_add",
    (Step(BIAS), Step(DROPOUT, optional=False), Step(RESIDUAL, optional=False)),
    anchor=DROPOUT,
)


# ---- memory-bound region chains (fuse_region) ---------------------------------------------------------------

# the chains' names (what findings' facts carry as `chain`); a dropout written by hand is DROPOUT
GELU_TANH = "gelu_tanh"
GELU_ERF = "gelu_erf"
SILU = "silu"
SIGMOID_GATE = "sigmoid_gate"
RELPOS_GATHER = "relpos_gather"


@dataclass(frozen=True)
class RegionChain:
    """A chain of memory-bound ops fuse_region recognises: `name` is what its findings carry
    (their facts' `chain`) and what the source matcher calls the form it found."""

    name: str
    label: str  # what the profile saw, as a finding titles it
    fix: str  # what apply writes, in words
    words: str  # in a sentence ("the profile saw a tanh GELU here")
    source_words: str = ""  # the narrower form the source rewrite reads, when there is one
    function: str = ""  # an activation: the call that replaces it (applied to x)
    # the replacing call's keyword arguments after x, each (name, its value as Python source)
    keywords: tuple[tuple[str, str], ...] = ()
    # one fix rewrites the whole function's pattern at once, though a matrix product splits the profile's
    # ops into several regions (DeBERTa's two relative-position terms each follow their own score product)
    whole_function: bool = False

    @property
    def found_words(self) -> str:
        """The source form's words (what a source match is called)."""
        return self.source_words or self.words


REGION_CHAINS: dict[str, RegionChain] = {
    c.name: c
    for c in (
        RegionChain(
            GELU_TANH,
            "tanh GELU written by hand",
            'torch.nn.functional.gelu(x, approximate="tanh")',
            "a tanh GELU",
            function="torch.nn.functional.gelu",
            keywords=(("approximate", '"tanh"'),),
        ),
        RegionChain(
            GELU_ERF,
            "erf GELU written by hand",
            "torch.nn.functional.gelu(x)",
            "an erf GELU",
            function="torch.nn.functional.gelu",
        ),
        RegionChain(
            SILU,
            "SiLU written by hand (x * sigmoid(x))",
            "torch.nn.functional.silu(x)",
            "SiLU",
            function="torch.nn.functional.silu",
        ),
        # the profile sees x * sigmoid(c * x) without c; the source rewrites it only where c is 1.702
        RegionChain(
            SIGMOID_GATE,
            "x * sigmoid(c * x) written by hand (QuickGELU when c = 1.702)",
            "opadvisor.kernels.quick_gelu(x) (when c is 1.702), else the regional compile",
            "x * sigmoid(c * x)",
            source_words="QuickGELU",
            function="opadvisor.kernels.quick_gelu",
        ),
        RegionChain(DROPOUT, "dropout written by hand", "opadvisor.kernels.dropout(x, p)", "a dropout"),
        RegionChain(
            RELPOS_GATHER,
            "relative-position gather with its elementwise neighbours",
            "opadvisor.kernels.disentangled_bias(c2p, p2c, c2p_index, p2c_index, scale)",
            "DeBERTa's relative-position scores",
            whole_function=True,
        ),
    )
}

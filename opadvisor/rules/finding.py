"""Findings: what a rule reports. Plain data, rendered by the CLI and consumed by `opadvisor/rewrite`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from opadvisor.rules.facts import Facts

F = TypeVar("F", bound="Facts")

FixSafety = Literal["safe", "unsafe", "none"]


@dataclass
class Evidence:
    ops: list[str] = field(
        default_factory=list
    )  # op names in the order they ran, e.g. ["aten::masked_fill", ...]
    kernel_count: int | None = None  # GPU kernels per step for the pattern (None on a CPU profile)
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    time_ms_per_step: float | None = None  # measured GPU time (CPU time on a CPU profile: see `time_basis`)
    share_of_step: float | None = None  # 0..1 of the median step
    time_basis: Literal["gpu", "cpu", "none"] = "none"
    occurrences: int = 1  # how many times per step the pattern ran at this site
    # the time as measured under the profiler, when the run's calibration scaled its GPU idle part to the
    # plain step (opadvisor/rules/_calibration.py); None for every other time
    profiled_time_ms_per_step: float | None = None
    notes: list[str] = field(default_factory=list)  # extra evidence in words


@dataclass
class Alternative:
    """Another finding whose fix rewrites the same lines another way (a rule's `ALTERNATIVES`; see
    `opadvisor.rules.engine.link_alternatives`): the user applies one of the two."""

    rule: str
    line: int
    end_line: int
    bigger_win: bool  # this finding's fix saves more than the other's

    def names(self, f: Finding) -> bool:
        """Whether `f` is the finding this names by its rule and first line (the caller compares files)."""
        return f.rule == self.rule and f.line == self.line


@dataclass
class Finding:
    rule: str
    path: str  # absolute path of the user's source file
    line: int  # 1-based first line of the pattern
    end_line: int  # 1-based last line of the pattern
    message: str  # one line a user understands: "3 kernels where one would do, 1.9 ms/step (15%)"
    fix: FixSafety
    function: str | None = None
    module: str | None = None  # module path, e.g. "encoder.layers.0.attn"
    evidence: Evidence = field(default_factory=Evidence)
    time_ms_per_step: float | None = None
    est_saving_ms_per_step: float | None = None
    advice: str = ""  # what to do, in words
    # the rule's facts (a `Facts` dataclass's `to_details()`), read typed with `facts(FactsClass)`
    details: dict[str, Any] = field(default_factory=dict)
    source_status: Literal["ok", "changed", "missing"] = "ok"  # the file now vs. at profile time
    ranks: list[int] | None = None  # multi-rank runs: the ranks where it was found
    # pattern in an installed library's code (then `path`/`line` are the library file's): the package,
    # version, path within site-packages, module class, the user's call site, the model's construction
    # site and the fix for library code (see opadvisor/rules/_library.py); None for the user's own code
    library: dict[str, Any] | None = None
    # Why the rule's automatic fix cannot be applied at this site (a dry run of its codemod, see
    # opadvisor/rewrite/check.py); `fix` is then "none". None: not blocked (or not checked).
    fix_blocked: str | None = None
    # engine bookkeeping, no fact of the pattern: the finding whose fix rewrites the same lines another way
    alternative: Alternative | None = None
    # True for a display-only finding (`fix` "none") whose fix `apply --rule RULE` makes when asked by name
    on_request: bool = False

    def facts(self, cls: type[F]) -> F:
        """The finding's facts as `cls`; a FactsError (naming the rule and the field) when they do not fit."""
        return cls.from_details(self.details, rule=self.rule)

    def details_json(self) -> dict[str, Any]:
        """`details` as the suggest JSON (schema 1) shows it: the facts, then the bookkeeping keys it has
        always carried there (`on_request`, `alternative`)."""
        out = dict(self.details)
        if self.on_request:
            out["on_request"] = True
        if self.alternative is not None:
            out["alternative"] = dataclasses.asdict(self.alternative)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> str:
        """The line range as profiled, as every command and format names it: "35-40", or "58"."""
        return f"{self.line}-{self.end_line}" if self.end_line != self.line else str(self.line)

    def verdict(self) -> str:
        """The fix verdict, in the words every command uses (issue 30): "safe", "unsafe", "no automatic fix
        here: <why>" once the dry run (opadvisor/rewrite/check.py) blocked it, else "no automatic fix"."""
        if self.fix_blocked:
            return f"no automatic fix here: {self.fix_blocked}"
        return "no automatic fix" if self.fix == "none" else self.fix

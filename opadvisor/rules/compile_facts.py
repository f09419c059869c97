"""What the profile proved about a torch.compile graph break or recompile: the contract between the
`graph_break` / `recompile` rules and their codemods (plain data, in each finding's `details`).

Kinds of graph break (`GraphBreakFacts.kind`), from dynamo's own reason for the break:

    "scalar_read"      `.item()`, `float(t)`, `int(t)`, `.tolist()`: a tensor read as a Python number
    "print"            `print(...)` (or a logging call) of a tensor
    "tensor_branch"    Python control flow on a tensor's value (`if y.max() > 0:`, `while t:`, `bool(t)`)
    "unsupported_call" a call dynamo cannot trace (a C extension, numpy on tensors, a skipped function)
    "other"            anything else (the reason says what)

Kinds of recompile (`RecompileFacts.kind`), from the guard that failed:

    "shape"            a tensor input's size changed (a varying sequence length or batch)
    "scalar"           a Python number argument changed (a learning rate, a temperature, a step counter)
    "dtype"            a tensor input's dtype changed
    "training"         a module's `training` flag flipped (train / eval)
    "other"            anything else (the reason says what)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opadvisor.rules.facts import Facts

BREAK_KINDS = ("scalar_read", "print", "tensor_branch", "unsupported_call", "other")
RECOMPILE_KINDS = ("shape", "scalar", "dtype", "training", "other")


@dataclass
class GraphBreakFacts(Facts):
    """One graph break, at the user's line (the finding's line is the statement holding it).

    kind: one of BREAK_KINDS. reason: dynamo's one-line reason ("Unsupported Tensor.item() call with
    capture_scalar_outputs=False"). line: the line dynamo broke at (inside the finding's statement span).
    function: the name of the function that line is in; function_line: the line of its `def`.
    compiled_function / compiled_line: the function whose compilation hit the break (the compiled frame,
    e.g. the model's `forward`; a resumed frame is named by its original function). graphs_per_step: how
    many compiled graphs ran per recorded step (every break adds one). compile_file / compile_line: the
    `torch.compile(...)` call (or `module.compile(...)`) that compiled the frame, when the profile recorded
    it (None otherwise).
    """

    RULES = ("graph_break",)

    kind: str = "other"
    reason: str = ""
    line: int | None = None
    function: str | None = None
    function_line: int | None = None
    compiled_function: str | None = None
    compiled_line: int | None = None
    graphs_per_step: float | None = None
    compile_file: str | None = None
    compile_line: int | None = None


@dataclass
class RecompileFacts(Facts):
    """Recompiles of one compiled function for one cause.

    kind: one of RECOMPILE_KINDS. reasons: dynamo's guard failures as it words them ("tensor 'x' size
    mismatch at index 1. expected 32, actual 31"), distinct, in order. input: the argument the guard is on
    ("x", or "self.training"), as dynamo names it without its `L[...]` wrapper; dim: the dimension that
    changed (kind "shape"); values: the values seen, in order ("32", "31"). function / function_line: the
    compiled function and its `def` line; file: its file. recompiles: how many times it was compiled again
    for this cause over the whole run; compile_s: the seconds those compiles took; cache_limit_hit: dynamo
    gave up compiling it and ran it eagerly (its recompile limit was reached). compile_file / compile_line:
    the `torch.compile(...)` call (or `module.compile(...)`) that compiled it, when the profile recorded it;
    compile_kwargs: the keyword arguments given there (`{"dynamic": "None", "fullgraph": "False"}`).
    """

    RULES = ("recompile",)

    kind: str = "other"
    reasons: list[str] = field(default_factory=list)
    input: str | None = None
    dim: int | None = None
    values: list[str] = field(default_factory=list)
    function: str | None = None
    function_line: int | None = None
    file: str | None = None
    recompiles: int = 0
    compile_s: float = 0.0
    cache_limit_hit: bool = False
    compile_file: str | None = None
    compile_line: int | None = None
    compile_kwargs: dict[str, str] = field(default_factory=dict)


@dataclass
class RegionalCompileFacts(Facts):
    """A model compiled whole whose repeated blocks could be compiled one at a time (regional compilation).

    model: the compiled model's class. block / block_qualified: the repeated block class (its name, and
    module.qualname); count: its instances; containers: the paths, from the compiled model, of the
    `nn.ModuleList`s / `nn.Sequential`s whose every child is a block ("blocks", "model.layers",
    "layers.0.blocks"); singles: the paths of blocks outside such containers; param_share: the blocks'
    share of the model's parameter tensors; outside: the outermost modules holding no block (they run
    eagerly once the blocks alone are compiled). variants: the graphs the blocks compile to (distinct sets
    of their Python-number attributes, on which dynamo specialises); differs: those attributes that differ. compile_s: the seconds torch.compile spent compiling the
    model in this run (every frame and recompile of it); compile_s_first_step: of those, in the first step.
    compile_file / compile_line: the `torch.compile(...)` (or `model.compile(...)`) call; compile_kwargs:
    its keyword arguments as written (`{"mode": "'max-autotune'"}`), passed on to each block's compile.
    """

    RULES = ("regional_compile",)

    model: str = ""
    block: str = ""
    block_qualified: str = ""
    count: int = 0
    containers: list[str] = field(default_factory=list)
    singles: list[str] = field(default_factory=list)
    param_share: float | None = None
    outside: list[str] = field(default_factory=list)
    variants: int = 1
    differs: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    compile_s_first_step: float = 0.0
    compile_file: str | None = None
    compile_line: int | None = None
    compile_kwargs: dict[str, str] = field(default_factory=dict)


__all__ = ["BREAK_KINDS", "RECOMPILE_KINDS", "GraphBreakFacts", "RecompileFacts", "RegionalCompileFacts"]

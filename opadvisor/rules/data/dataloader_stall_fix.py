"""Codemod for `dataloader_stall`: load batches in worker processes, pinned, and copy them asynchronously.

What it rewrites:
- the `torch.utils.data.DataLoader(...)` construction (however imported) gets `num_workers=`,
  `pin_memory=True` and `persistent_workers=True` where the call does not set them;
- in every loop over that loader (`for batch in loader`, `enumerate(loader)`, `tqdm(loader)`), the
  host-to-device copies of the batch (`x.to(device)`, `batch["ids"].to(device)`, `y.cuda()`, and copies in
  comprehensions over the batch) get `non_blocking=True`.

`num_workers`: the default is the expression `min(8, os.cpu_count() or 1)` (and `import os`), evaluated
where the script runs. A number computed at rewrite time would be the core count of the machine that ran
`opadvisor apply`, not of the one that trains; the cap of 8 keeps several ranks per host from spawning
hundreds of workers, and `or 1` covers `os.cpu_count()` returning None. The constructor's `num_workers`
keyword replaces it (an int becomes a literal, a str is inserted as the expression).

Fix safety: unsafe. Worker processes pickle the dataset (and collate_fn, worker_init_fn) under the spawn
and forkserver start methods (macOS, Windows, Linux from Python 3.14) and re-run an unguarded script; a
dataset holding an open file, a database handle or a CUDA tensor breaks or misbehaves in a worker; an
IterableDataset yields its whole stream once per worker unless it shards with `get_worker_info()`.
`non_blocking=True` is applied only to copies of batch data to a device other than "cpu" (a device-to-host
copy with non_blocking can be read before it lands).

Refused (left alone, with the reason): a DataLoader call with `*args`/`**kwargs` or `num_workers` given by
position; `num_workers` the user set to something other than 0 (kept; `persistent_workers` then is added
only when that is a literal > 0, since it raises with 0 workers); a dataset whose class, defined in the
same file, is an IterableDataset that never calls `get_worker_info()`, or makes CUDA tensors in
`__getitem__`/`__iter__` (workers stay 0, `pin_memory` is still added); a copy call that already passes
`non_blocking` or passes it by position, or unpacks arguments.

Targets: a target may name the DataLoader construction, the `for` line of a loop over it (or the
`next(...)` line that takes a batch), or a copy line; naming any of them rewrites the construction and
the copies in its loops. Facts used (`DataLoaderFacts`): `copies` (the host-to-device copies the profile measured,
each with `path`, `line`, `end_line`): the `.to(...)`/`.cuda(...)` calls on those lines of this file (the
engine's `CodemodContext.filename`) get `non_blocking=True` even when their loop cannot be tied to a
loader by reading the code (the loader built in another file, say).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider, ScopeProvider

from opadvisor.rewrite.base import RuleCodemod, Target
from opadvisor.rewrite.toolkit import (
    Visitor,
    append_keywords,
    code,
    has_star_args,
    keyword,
    layout,
    positional_count,
    qualified,
    replace_keyword_value,
)
from opadvisor.rules.data.dataloader_stall import DataLoaderFacts

DATALOADERS = frozenset({"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"})
ITERABLE_DATASETS = frozenset(
    {"torch.utils.data.IterableDataset", "torch.utils.data.dataset.IterableDataset"}
)
DEFAULT_NUM_WORKERS = "min(8, os.cpu_count() or 1)"
# Calls that wrap an iterable without changing what it yields (for the purpose of finding the loader).
WRAPPERS = frozenset({"enumerate", "tqdm", "tqdm.tqdm", "tqdm.auto.tqdm", "iter"})
TORCH_DTYPES = frozenset(
    f"torch.{d}"
    for d in "float float16 float32 float64 half double bfloat16 int int8 int16 int32 int64 long short uint8 "
    "bool complex64 complex128".split()
)


def _root_name(expr: cst.BaseExpression) -> str | None:
    """`batch` for `batch`, `batch["x"]`, `batch.x`, `batch[0].float()`, `batch.items()`; else None."""
    while True:
        if isinstance(expr, cst.Name):
            return expr.value
        if isinstance(expr, cst.Attribute | cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            expr = expr.func.value
        else:
            return None


def _target_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Tuple | cst.List):
        return set().union(*(_target_names(e.value) for e in target.elements)) if target.elements else set()
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    return set()


class _BatchNames(Visitor):
    """Names bound to batch data inside a loop body: the loop's targets, what is unpacked or indexed from
    them, and the targets of comprehensions over them. Nested functions and classes are not entered."""

    def __init__(self, names: set[str]) -> None:
        self.names = set(names)
        self.grew = False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def _bind(self, targets: set[str], value: cst.BaseExpression | None) -> None:
        if value is not None and _root_name(value) in self.names and not targets <= self.names:
            self.names |= targets
            self.grew = True

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._bind(_target_names(t.target), node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(_target_names(node.target), node.value)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._bind(_target_names(node.target), node.iter)

    def visit_For(self, node: cst.For) -> None:
        self._bind(_target_names(node.target), node.iter)


class _Copies(Visitor):
    """The `.to(...)` / `.cuda(...)` calls on batch data in a loop body (nested defs not entered)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.calls: list[cst.Call] = []

    visit_FunctionDef = _BatchNames.visit_FunctionDef
    visit_ClassDef = _BatchNames.visit_ClassDef
    visit_Lambda = _BatchNames.visit_Lambda

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value in ("to", "cuda")
            and _root_name(func.value) in self.names
        ):
            self.calls.append(node)


class DataLoaderCodemod(RuleCodemod):
    """Workers, pinned memory and asynchronous copies for DataLoaders (facts used: `copies`)."""

    RULE: ClassVar[str] = "dataloader_stall"
    FACTS = DataLoaderFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("loader",)  # DataLoader, and loops over a `train_loader`
    NO_KERNEL_OP: ClassVar[str] = "DataLoader workers, pinned memory and non_blocking copies: no op of ours"
    SAFETY: ClassVar[str] = "unsafe"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (
        PositionProvider,
        QualifiedNameProvider,
        ScopeProvider,
        ParentNodeProvider,
    )

    def __init__(
        self,
        context: CodemodContext,
        targets: Sequence[Target] | None = None,
        *,
        num_workers: int | str | None = None,
    ) -> None:
        super().__init__(context, targets)
        if isinstance(num_workers, bool) or (isinstance(num_workers, int) and num_workers < 1):
            raise ValueError(f"num_workers must be a positive int or an expression, not {num_workers!r}")
        self.num_workers_expr = DEFAULT_NUM_WORKERS if num_workers is None else str(num_workers)
        self._loaders: set[cst.Call] = set()  # constructions to rewrite
        self._copies: dict[cst.Call, str] = {}  # copy calls to rewrite -> the loop's iterable, in words
        self._has_main_guard = False
        self._all_loaders: set[cst.Call] = set()
        self._by_attr: dict[str, list[cst.Call]] = {}

    # ---- pre-pass: which constructions and which copies -------------------------------------------------
    def visit_Module(self, node: cst.Module) -> None:
        self._has_main_guard = any(
            m.matches(
                s,
                m.If(test=m.Comparison(left=m.Name("__name__"), comparisons=[m.ComparisonTarget(m.Equal())])),
            )
            for s in node.body
        )
        self._all_loaders = {c for c in m.findall(node, m.Call()) if qualified(self, c.func) & DATALOADERS}
        by_attr: dict[str, list[cst.Call]] = {}  # `self.loader = DataLoader(...)` -> "loader"
        for call in self._all_loaders:
            parent = self.get_metadata(ParentNodeProvider, call)
            targets = [t.target for t in parent.targets] if isinstance(parent, cst.Assign) else []
            for t in targets:
                if isinstance(t, cst.Attribute):
                    by_attr.setdefault(t.attr.value, []).append(call)
        self._by_attr = by_attr

        # Where batches are taken: `for <targets> in <loader>:` (the loop's body), and
        # `<targets> = next(<iterator of a loader>)` (the body of the loop around it).
        sites: list[tuple[cst.CSTNode, cst.BaseExpression, cst.BaseExpression, cst.CSTNode]] = []
        for loop in m.findall(node, m.For()):
            sites.append((loop, loop.target, loop.iter, loop.body))
        for assign in m.findall(node, m.Assign(value=m.Call(func=m.Name("next"), args=[m.Arg()]))):
            body = self._enclosing_loop_body(assign)
            if body is not None and len(assign.targets) == 1:
                sites.append((assign, assign.targets[0].target, assign.value.args[0].value, body))
        for header, target, it, body in sites:
            linked, described = self._loaders_of(it)
            if linked is None:
                continue
            finder = _BatchNames(_target_names(target))
            finder.grew = True
            while finder.grew:
                finder.grew = False
                body.visit(finder)
            copies = _Copies(finder.names)
            body.visit(copies)
            if (
                self.targets is None
                or self._header_targeted(header, it)
                or any(self.targeted(c) for c in copies.calls)
            ):
                self._loaders.update(linked)
                self._copies.update({c: described for c in copies.calls})
            elif any(self.targeted(c) for c in linked):
                self._copies.update({c: described for c in copies.calls})
        for call in self._all_loaders:
            if self.targeted(call) is not None:
                self._loaders.add(call)
        # The copies the profile measured (the facts' `copies`: path, line, end_line), wherever they are.
        spans = self._profiled_copy_lines()
        for call in m.findall(node, m.Call(func=m.Attribute(attr=m.Name("to") | m.Name("cuda")))):
            start, end = self.lines_of(call)
            line = next((a for a, b in spans if start <= b and a <= end), None)
            if line is not None and call not in self._copies:
                self._copies[call] = f"the copy the profile measured at line {line}"

    def _profiled_copy_lines(self) -> list[tuple[int, int]]:
        filename = self.context.filename
        if not filename or not self.targets:
            return []
        here = Path(filename).resolve()
        spans = []
        for target in self.targets:
            facts = self.facts_of(target)
            for site in facts.copies if facts is not None else []:
                if Path(site.path).resolve() == here:
                    spans.append((site.line, site.end_line))
        return spans

    def _enclosing_loop_body(self, node: cst.CSTNode) -> cst.CSTNode | None:
        while node is not None and not isinstance(node, cst.FunctionDef | cst.ClassDef | cst.Module):
            parent = self.get_metadata(ParentNodeProvider, node, None)
            if isinstance(parent, cst.For | cst.While) and node is parent.body:
                return node
            node = parent
        return None

    def _header_targeted(self, header: cst.CSTNode, it: cst.BaseExpression) -> bool:
        start = self.lines_of(header)[0]
        end = self.lines_of(it)[1]
        return any(start <= t.end_line and t.line <= end for t in self.targets or [])

    def _loaders_of(self, it: cst.BaseExpression, depth: int = 0) -> tuple[list[cst.Call] | None, str]:
        """The constructions an iterable comes from ([] when it is a loader by name only), or None.

        Seen through `enumerate(...)`, `tqdm(...)`, `iter(...)`, and names assigned from those."""
        while isinstance(it, cst.Call) and it.args and it not in self._all_loaders:
            func = code(it.func)
            if func not in WRAPPERS and not qualified(self, it.func) & WRAPPERS:
                return None, ""
            it = it.args[0].value
        described = code(it)
        if isinstance(it, cst.Call):
            return ([it], described) if it in self._all_loaders else (None, "")
        if isinstance(it, cst.Name):
            found: list[cst.Call] = []
            scope = self.get_metadata(ScopeProvider, it, None)
            for assignment in scope[it.value] if scope is not None and it.value in scope else []:
                parent = self.get_metadata(ParentNodeProvider, assignment.node, None)
                if isinstance(parent, cst.AssignTarget):
                    parent = self.get_metadata(ParentNodeProvider, parent, None)
                if isinstance(parent, cst.Assign | cst.AnnAssign) and parent.value is not None and depth < 3:
                    linked, _ = self._loaders_of(parent.value, depth + 1)
                    found.extend(linked or [])
            if found:
                return found, described
            return ([], described) if "loader" in it.value.lower() else (None, "")
        if isinstance(it, cst.Attribute):
            if it.attr.value in self._by_attr:
                return self._by_attr[it.attr.value], described
            return ([], described) if "loader" in it.attr.value.lower() else (None, "")
        return None, ""

    # ---- rewrites -------------------------------------------------------------------------------------------
    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if original_node in self._loaders:
            return self._rewrite_loader(original_node, updated_node)
        if original_node in self._copies:
            return self._rewrite_copy(original_node, updated_node)
        return updated_node

    def _rewrite_loader(self, call: cst.Call, updated: cst.Call) -> cst.Call:
        star = has_star_args(call)
        if star is not None:
            self.skip(
                call, f"DataLoader(...) unpacks {star}, which may set num_workers or pin_memory already"
            )
            return updated
        if positional_count(call) > 5:
            self.skip(
                call, "DataLoader(...) passes num_workers (or later arguments) by position; set them by hand"
            )
            return updated
        done: list[str] = []
        notes: list[str] = []
        add: list[tuple[str, cst.BaseExpression]] = []

        workers_known = False  # num_workers > 0 for sure after the rewrite
        added_workers = False
        nw = keyword(call, "num_workers")
        unsafe_dataset = self._worker_unsafe_dataset(call)
        if nw is not None and not m.matches(nw.value, m.Integer("0")):
            workers_known = isinstance(nw.value, cst.Integer) and int(nw.value.value, 0) > 0
            notes.append(f"num_workers={code(nw.value)} was set by the user: left as is")
        elif unsafe_dataset is not None:
            self.skip(call, f"num_workers left at 0: {unsafe_dataset}")
        else:
            value = cst.parse_expression(self.num_workers_expr)
            if nw is None:
                add.append(("num_workers", value))
            else:
                updated = replace_keyword_value(updated, "num_workers", value)
            if "os." in self.num_workers_expr:
                AddImportsVisitor.add_needed_import(self.context, "os")
            done.append(f"num_workers={self.num_workers_expr}")
            workers_known = added_workers = True

        pin = keyword(call, "pin_memory")
        if pin is None:
            add.append(("pin_memory", cst.Name("True")))
            done.append("pin_memory=True")
        elif not m.matches(pin.value, m.Name("True")):
            notes.append(f"pin_memory={code(pin.value)} was set by the user: left as is")

        persistent = keyword(call, "persistent_workers")
        if persistent is None and workers_known:
            add.append(("persistent_workers", cst.Name("True")))
            done.append("persistent_workers=True")
        elif persistent is None and nw is not None and not m.matches(nw.value, m.Integer("0")):
            notes.append(
                f"persistent_workers not added: num_workers={code(nw.value)} may be 0, where it raises"
            )

        if not done:
            if notes:
                self.skip(call, "DataLoader(...) already tuned: " + "; ".join(notes))
            return updated
        said = f" ({'; '.join(notes)})" if notes else ""
        self.record_change(call, f"DataLoader(..., {', '.join(done)}){said}")
        self._caution(call, added_workers, done)
        return append_keywords(updated, add, **layout(self, call))

    def _caution(self, call: cst.Call, added_workers: bool, done: list[str]) -> None:
        """A note on what the added worker settings change beyond speed (pickling, seeds, the main guard)."""
        cautions = []
        if added_workers:
            cautions.append(
                "worker processes need a picklable dataset (and collate_fn) that works outside the main "
                "process; random transforms in the dataset now draw from the workers' seeds"
            )
            if not self._has_main_guard:
                cautions.append(
                    'the script has no `if __name__ == "__main__":` guard: under the spawn or forkserver '
                    "start method (macOS, Windows, Linux from Python 3.14) every worker re-runs it"
                )
        if "persistent_workers=True" in done:
            cautions.append(
                "persistent workers draw their base seed from the loader's generator (or the global RNG) once, "
                "not every epoch: from the second epoch on, shuffling and random numbers differ from before"
            )
        if cautions:
            self.note(call, "; ".join(cautions))

    def _worker_unsafe_dataset(self, call: cst.Call) -> str | None:
        """Why the dataset cannot go to workers, when its class is in this file and says so; else None."""
        dataset = keyword(call, "dataset")
        value = (
            dataset.value
            if dataset is not None
            else next((a.value for a in call.args if a.keyword is None and not a.star), None)
        )
        cls = self._class_of(value)
        if cls is None:
            return None
        bases = set().union(*(qualified(self, b.value) for b in cls.bases)) if cls.bases else set()
        uses_worker_info = bool(
            m.findall(cls, m.Name("get_worker_info") | m.Attribute(attr=m.Name("get_worker_info")))
        )
        if bases & ITERABLE_DATASETS and not uses_worker_info:
            return (
                f"{cls.name.value} is an IterableDataset that does not shard with get_worker_info(): "
                "each worker would yield the whole stream"
            )
        for method in m.findall(cls, m.FunctionDef(name=m.Name("__getitem__") | m.Name("__iter__"))):
            cuda = m.findall(
                method,
                m.Call(func=m.Attribute(attr=m.Name("cuda")))
                | m.Arg(keyword=m.Name("device"), value=m.SimpleString())
                | m.Call(
                    func=m.Attribute(attr=m.Name("to")), args=[m.Arg(value=m.SimpleString()), m.ZeroOrMore()]
                ),
            )
            if any("cuda" in code(c) for c in cuda):
                return (
                    f"{cls.name.value}.{method.name.value} makes CUDA tensors (line {self.lines_of(cuda[0])[0]}): "
                    "CUDA cannot be used in forked workers"
                )
        return None

    def _class_of(self, value: cst.BaseExpression | None) -> cst.ClassDef | None:
        """The class defined in this file that `value` (`Ds(...)` or a name assigned from it) instantiates."""
        if isinstance(value, cst.Name):
            scope = self.get_metadata(ScopeProvider, value, None)
            if scope is None or value.value not in scope:
                return None
            for assignment in scope[value.value]:
                parent = self.get_metadata(ParentNodeProvider, assignment.node, None)
                if isinstance(parent, cst.AssignTarget):
                    parent = self.get_metadata(ParentNodeProvider, parent, None)
                if isinstance(parent, cst.Assign | cst.AnnAssign) and isinstance(parent.value, cst.Call):
                    found = self._class_of(parent.value)
                    if found is not None:
                        return found
            return None
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
            scope = self.get_metadata(ScopeProvider, value.func, None)
            if scope is None or value.func.value not in scope:
                return None
            for assignment in scope[value.func.value]:
                if isinstance(assignment.node, cst.ClassDef):
                    return assignment.node
        return None

    def _rewrite_copy(self, call: cst.Call, updated: cst.Call) -> cst.Call:
        method = call.func.attr.value  # type: ignore[attr-defined]
        if keyword(call, "non_blocking") is not None:
            return updated  # already asynchronous (or deliberately not): nothing to say
        star = has_star_args(call)
        if star is not None:
            self.skip(call, f".{method}(...) unpacks {star}, which may set non_blocking already")
            return updated
        positional = [a.value for a in call.args if a.keyword is None]
        if method == "cuda" and positional[1:] or method == "to" and len(positional) > 2:
            self.skip(call, f".{method}(...) passes non_blocking (or later arguments) by position")
            return updated
        if any(m.matches(v, m.Name("True") | m.Name("False")) for v in positional):
            self.skip(call, f".{method}(...) passes a bool by position (non_blocking?)")
            return updated
        if method == "to":
            device = keyword(call, "device")
            dev = device.value if device is not None else (positional[0] if positional else None)
            if dev is None:
                return updated  # .to(dtype=...): no copy between devices
            if isinstance(dev, cst.Call) and dev.args and "torch.device" in qualified(self, dev.func):
                dev = dev.args[0].value
            if isinstance(dev, cst.SimpleString) and str(dev.evaluated_value).startswith("cpu"):
                return updated  # device-to-host: non_blocking would let the host read before the copy lands
            if qualified(self, dev) & TORCH_DTYPES:
                return updated  # a dtype conversion on the same device
        self.record_change(
            call, f".{method}(..., non_blocking=True): asynchronous copy of a batch from {self._copies[call]}"
        )
        return append_keywords(updated, [("non_blocking", cst.Name("True"))], **layout(self, call))

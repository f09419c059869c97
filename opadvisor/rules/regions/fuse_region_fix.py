"""Codemod for `fuse_region`: exact equivalents for recognised chains, regional compilation for the rest.

For each finding (its facts' `chain` says what the profile saw) the first of these that applies:

1. Activations written by hand, in any spelling the algebra of `_algebra.py` reads (method or function
   calls, `x ** 3` / `torch.pow(x, 3.0)` / `x * x * x`, constants spelled out or computed, temporaries
   bound earlier in the block and read nowhere else), anywhere in an expression:
       0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))  ->  F.gelu(x, approximate="tanh")
       0.5 * x * (1 + erf(x / sqrt(2)))                              ->  F.gelu(x)
       x * sigmoid(x)                                                ->  F.silu(x)
       x * sigmoid(1.702 * x)                                        ->  opadvisor.kernels.quick_gelu(x)
   Safe: the same function up to rounding (constants within a relative 1e-5 of the exact ones). Inside an
   autograd.Function's forward only the forward is rewritten; its hand-written backward stays.
2. Dropout written by hand (see `_dropout_match.py`): inline, the expression becomes
   `opadvisor.kernels.dropout(x, p)`; as an autograd.Function whose forward applies such a mask and whose
   backward applies the same saved mask and scale to the gradient (DeBERTa's XDropout), every
   `Fn.apply(x, p)` of the file becomes `opadvisor.kernels.dropout(x, p)`. Safe: the same distribution
   from a different random stream. A mask that is read elsewhere (returned, stored) is never replaced.
3. DeBERTa's relative-position scores: in one block, `A = torch.gather(S1, dim=-1, index=I1.expand(...))`,
   `score = A / scale`, `B = torch.gather(S2, dim=-1, index=I2.expand(...)).transpose(-1, -2)`,
   `score += B / scale` become `score = opadvisor.kernels.disentangled_bias(S1, S2, I1, I2, scale)` (the
   statements in between kept), when the gathered tensors are read nowhere else.
4. Anything else the profile found (an unrecognised chain, or a recognised one whose source is not in a
   form above): `@opadvisor.kernels.compile_region` on the innermost function holding the lines (regional
   torch.compile; the original runs, with one line printed, if compiling fails). Not for a generator, the
   forward/backward of an autograd.Function, or code outside any function (skipped with the reason).

The profile's facts guard the rewrite: a finding whose chain is a tanh GELU is not served by an erf GELU
in the source (skipped, with what each saw). In static mode (`opadvisor apply --rule fuse_region FILE`)
the exact equivalents (1-3) are rewritten wherever they match; regional compilation needs a profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import libcst as cst
from libcst.codemod import CodemodContext

from opadvisor.rewrite.base import Note, Target
from opadvisor.rewrite.toolkit import (
    BlockEdit,
    BlockRewriter,
    Converter,
    DropoutMatch,
    DropoutMatcher,
    Resolver,
    Transformer,
    Visitor,
    activation_of,
    analysing,
    block_index,
    code,
    names_in,
    nodes_of,
    parent,
    qualified,
    simple_binding,
)
from opadvisor.rules.patterns import DROPOUT, REGION_CHAINS, RELPOS_GATHER
from opadvisor.rules.regions.fuse_region import FuseRegionFacts

KERNELS = "opadvisor.kernels"
COMPILE_REGION = f"{KERNELS}.compile_region"
AUTOGRAD_FUNCTION = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
# ---- the codemod ---------------------------------------------------------------------------------------------


@dataclass
class _DropoutFunction:
    """A verified dropout autograd.Function: which parameter is x, and p in terms of the parameters."""

    params: list[str]
    x_index: int
    p: cst.BaseExpression
    calls: int = 0


@dataclass
class _Plan:
    functions: dict[str, _DropoutFunction] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # class name -> why it is not rewritten
    class_lines: dict[str, tuple[int, int]] = field(default_factory=dict)


class FuseRegionCodemod(BlockRewriter):
    RULE = "fuse_region"
    FACTS = FuseRegionFacts
    # one op per exact form (compile_region, the fallback, is torch.compile: it keeps no dispatch record)
    KERNEL_OP = ("dropout", "quick_gelu", "disentangled_bias")
    SAFETY = "safe"
    RANDOM_ONLY = False  # True in the parity twin: only the dropout rewrites
    # static mode's exact forms: activations by hand, dropouts by hand, DeBERTa's relative-position gathers
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = (
        *("tanh", r"\berf", "sigmoid", r"\bexp\b"),
        *("dropout", "bernoulli", r"\brand"),
        "gather",
    )

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context, targets)
        self.served: set[int] = set()  # indices of targets an exact rewrite (or a refusal) answered
        self.targets_only = 0  # changes static mode never makes (regional compiles): see the engine
        self.plan = _Plan()
        self._classes: list[bool] = []  # per enclosing class: is it an autograd.Function?
        self.compile_with: dict[int, list[tuple[int, str]]] = {}  # id(caller def) -> (target line, Function)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._classes.append(any(qualified(self, b.value) & AUTOGRAD_FUNCTION for b in node.bases))
        return True

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._classes.pop()
        return updated_node

    # ---- targets ----------------------------------------------------------------------------------------
    def _chain(self, target: Target) -> str | None:
        """The chain the profile saw at the target ("silu", "dropout", ...; None: unnamed ops or no facts)."""
        facts = self.facts_of(target)
        return facts.chain if facts is not None else None

    def _target_index(self, start: int, end: int) -> int | None:
        for i, t in enumerate(self.targets or ()):
            if start <= t.end_line and t.line <= end:
                return i
        return None

    def _wants(self, spans: Sequence[tuple[int, int]], kind: str, node: cst.CSTNode) -> bool:
        """Whether a match of `kind` over these lines is to be rewritten: always in static mode; in
        profile mode when a finding covers it and saw the same chain (else say why not)."""
        if self.targets is None:
            return True
        for start, end in spans:
            i = self._target_index(start, end)
            if i is None:
                continue
            chain = self._chain(self.targets[i])
            if chain == kind:
                self.served.add(i)
                return True
            if chain in REGION_CHAINS:
                self.served.add(i)
                saw, computes = REGION_CHAINS[chain].words, REGION_CHAINS[kind].found_words
                self.skip(node, f"the profile saw {saw} here, the source computes {computes}")
            return False
        return False

    # ---- module-level scan: dropout autograd.Functions -------------------------------------------------------
    def visit_Module(self, node: cst.Module) -> bool:
        super().visit_Module(node)
        found = nodes_of(node, (cst.ClassDef, cst.Call))  # one walk of the file for both
        for cls in (n for n in found if isinstance(n, cst.ClassDef)):
            if any(qualified(self, b.value) & AUTOGRAD_FUNCTION for b in cls.bases):
                self._scan_function(cls)
        for call in (n for n in found if isinstance(n, cst.Call)) if self.plan.functions else ():
            name = _apply_of(call)
            if name in self.plan.functions:
                self.plan.functions[name].calls += 1
        for name, fn in self.plan.functions.items():
            i = self._function_targeted(name)
            if i is not None and self.targets is not None and self._chain(self.targets[i]) == DROPOUT:
                self.served.add(i)
                if not fn.calls:
                    line = self.plan.class_lines[name][0]
                    self.skipped.append(
                        Note(
                            line,
                            f"{name} is a dropout written by hand, but nothing in this file calls {name}.apply",
                        )
                    )
        if self.targets is not None and not self.RANDOM_ONLY:
            self._compile_callers(node)
        return True

    def _compile_callers(self, module: cst.Module) -> None:
        """A region inside an autograd.Function (other than a dropout it replaces) is compiled with the
        code that calls it: the functions holding its `Fn.apply(...)` calls get the decorator (dynamo
        traces the Function's forward and backward inside them)."""
        calls: dict[str, list[cst.Call]] = {}
        for call in nodes_of(module, cst.Call):
            name = _apply_of(call)
            if name in self.plan.class_lines:
                calls.setdefault(name, []).append(call)
        for name, (start, end) in self.plan.class_lines.items():
            for i, t in enumerate(self.targets or ()):
                if i in self.served or not (start <= t.line and t.end_line <= end):
                    continue
                callers = {id(f): f for c in calls.get(name, []) if (f := self._enclosing_def(c)) is not None}
                self.served.add(i)
                if self._chain(t) == DROPOUT and name in self.plan.refused:
                    why = self.plan.refused[name]
                    self.skipped.append(
                        Note(t.line, f"{name}: not replaced by opadvisor.kernels.dropout: {why}")
                    )
                if not callers:
                    self.skipped.append(Note(t.line, f"not compiled: {name} is an autograd.Function and nothing "
                                             f"in this file calls {name}.apply"))  # fmt: skip
                    continue
                for fid in callers:
                    self.compile_with.setdefault(fid, []).append((t.line, name))

    def _enclosing_def(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        current = parent(self, node)
        while current is not None and not isinstance(current, cst.FunctionDef):
            current = parent(self, current)
        return current

    def _scan_function(self, cls: cst.ClassDef) -> None:
        name = cls.name.value
        start, end = self.lines_of(cls)
        self.plan.class_lines[name] = (start, end)
        methods = {
            s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)
        }  # fmt: skip
        forward, backward = methods.get("forward"), methods.get("backward")
        if forward is None or backward is None:
            return
        with analysing(name, "forward"):  # read before the traversal reaches the class
            found = _verify_dropout_function(self, forward, backward)
        if isinstance(found, str):
            self.plan.refused[name] = found
        else:
            self.plan.functions[name] = found

    def _function_targeted(self, name: str) -> int | None:
        lines = self.plan.class_lines.get(name)
        return None if lines is None else self._target_index(*lines)

    # ---- 1-3: rewrites inside blocks ----------------------------------------------------------------------
    def block_edits(self, stmts: Sequence[cst.BaseStatement], indent: str) -> list[BlockEdit]:
        edits: list[BlockEdit] = []
        taken: set[int] = set()
        relpos = None if self.RANDOM_ONLY else self._relpos_edit(stmts)
        if relpos is not None:
            edits.append(relpos)
            taken |= {relpos.last, *(relpos.removed or ())}
        # profile mode: a match spans its statement and earlier ones, so none ending before every target can
        # overlap one (not analysed)
        first_line = min((t.line for t in self.targets), default=0) if self.targets is not None else 0
        for k, stmt in enumerate(stmts):
            if k in taken or not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
                continue
            if first_line and self.stmt_lines(stmts, k, k)[1] < first_line:
                continue
            value = getattr(stmt.body[0], "value", None)
            if not isinstance(value, cst.BaseExpression):
                continue
            edit = self._expression_edit(stmts, k, value)
            if edit is not None and not (taken & ({edit.last} | set(edit.removed or ()))):
                edits.append(edit)
                taken |= {edit.last, *(edit.removed or ())}
        return edits

    def _expression_edit(
        self, stmts: Sequence[cst.BaseStatement], k: int, value: cst.BaseExpression
    ) -> BlockEdit | None:
        for node in _preorder(value):
            if not isinstance(node, (cst.BinaryOperation, cst.Call)):
                continue
            if _apply_of(node) is not None:
                continue  # Fn.apply(...): leave_Call's business
            for resolver in () if self.RANDOM_ONLY else (Resolver(stmts, k, k), Resolver(stmts, k)):
                # as written, then through temporaries
                conv = Converter(self, resolver.resolve)
                poly = conv.poly(node)
                act = activation_of(poly) if poly is not None and not resolver.stale else None
                if act is not None:
                    return self._activation_edit(stmts, k, node, act, conv, resolver)
            if self._classes and self._classes[-1]:
                continue  # a dropout inside an autograd.Function goes with its backward: see leave_Call
            resolver = Resolver(stmts, k)
            dm = DropoutMatcher(self, resolver.resolve).match(node)
            if dm is not None and not resolver.stale:
                return self._dropout_edit(stmts, k, node, dm, resolver)
        return None

    def _spans(self, stmts, k: int, used: dict[str, int]) -> list[tuple[int, int]]:
        return [self.stmt_lines(stmts, j, j) for j in sorted({k, *used.values()})]

    def _temporaries(
        self,
        stmts: Sequence[cst.BaseStatement],
        k: int,
        node: cst.CSTNode,
        keep: Sequence[cst.CSTNode],
        resolver: Resolver,
    ) -> tuple[frozenset[int], str | None]:
        """(statements to remove, or why the temporaries cannot go): the bindings of names the matched
        `node` read through and its replacement (made of the `keep` nodes) no longer reads, when nothing
        else reads them."""
        still = {
            code(n) for kept in keep for n in [*nodes_of(kept, cst.Name), *nodes_of(kept, cst.Attribute)]
        }
        inside = {id(n) for n in [*nodes_of(node, cst.Name), *nodes_of(node, cst.Attribute)]}
        removed: dict[str, int] = {}
        pending = [t for t in resolver.used if t not in still and _reads(node, t, set())]
        while pending:
            text = pending.pop()
            j = resolver.used.get(text)
            if j is None or text in removed:
                continue
            removed[text] = j
            value = simple_binding(stmts[j])[text]
            pending += [
                t for t in resolver.used if t not in still and t not in removed and _reads(value, t, set())
            ]
        gone = set(removed.values())
        for text, j in removed.items():
            for i in range(j + 1, len(stmts)):
                if i in gone:
                    continue
                if _reads(stmts[i], text, inside if i == k else set()):
                    line = self.stmt_lines(stmts, i, i)[0]
                    return frozenset(), f"`{text}` is read again at line {line}"
                if text in block_index(stmts).binds[i]:
                    break
        return frozenset(gone), None

    def _activation_edit(self, stmts, k, node, act, conv, resolver) -> BlockEdit | None:
        kind, x_text = act
        if not self._wants(self._spans(stmts, k, resolver.used), kind, node):
            return None
        x = conv.leaves[x_text]
        removed, why = self._temporaries(stmts, k, node, [x], resolver)
        if why is not None:
            self.skip(node, f"{REGION_CHAINS[kind].found_words} written by hand, not rewritten: {why}")
            return None
        new = _activation_call(self.ref(REGION_CHAINS[kind].function), x, REGION_CHAINS[kind].keywords)
        new = new.with_changes(lpar=node.lpar, rpar=node.rpar) if getattr(node, "lpar", None) else new
        self.record_change(node, f"{REGION_CHAINS[kind].found_words} written by hand -> {code(new.func)}")
        return BlockEdit(k, k, {id(node): new}, carried=[x], removed=removed)

    def _dropout_edit(self, stmts, k, node, dm: DropoutMatch, resolver: Resolver) -> BlockEdit | None:
        if not self._wants(self._spans(stmts, k, resolver.used), DROPOUT, node):
            return None
        removed, why = self._temporaries(stmts, k, node, [dm.x, dm.p], resolver)
        if why is not None:
            self.skip(
                node, f"a dropout written by hand, not rewritten: {why} (its mask must stay the one applied)"
            )
            return None
        new = cst.Call(self.ref(f"{KERNELS}.dropout"), [cst.Arg(dm.x, comma=_comma()), cst.Arg(dm.p)])
        new = new.with_changes(lpar=node.lpar, rpar=node.rpar) if getattr(node, "lpar", None) else new
        self.record_change(node, f"dropout written by hand -> {code(new.func)}(x, {dm.p_text})")
        return BlockEdit(k, k, {id(node): new}, carried=[dm.x, dm.p], removed=removed)

    # ---- 2: call sites of a dropout autograd.Function ----------------------------------------------------------
    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        name = _apply_of(original_node)
        fn = self.plan.functions.get(name or "")
        if fn is None:
            return updated_node
        i = self._function_targeted(name)  # type: ignore[arg-type]
        if self.targets is not None and (i is None or self._chain(self.targets[i]) != DROPOUT):
            return updated_node
        args = list(updated_node.args)
        if len(args) != len(fn.params) or any(a.keyword is not None or a.star for a in args):
            self.skip(original_node, f"{name}.apply: arguments this rewrite does not map to {fn.params}")
            return updated_node
        by_param = {p: a.value for p, a in zip(fn.params, args, strict=True)}
        p_expr = _substitute(fn.p, by_param)
        x = by_param[fn.params[fn.x_index]]
        new = cst.Call(self.ref(f"{KERNELS}.dropout"), [cst.Arg(x, comma=_comma()), cst.Arg(p_expr)])
        message = f"{name}.apply (dropout written by hand) -> {code(new.func)}"
        if i is not None:  # say it at the finding's lines too (the Function), where the profile saw it
            line = self.lines_of(original_node)[0]
            self.changes.append(Note(self.targets[i].line, f"{message} (the call at line {line})"))  # type: ignore[index]
        else:
            self.record_change(original_node, message)
        return new

    # ---- 3: DeBERTa's relative-position scores ---------------------------------------------------------------------
    def _relpos_edit(self, stmts: Sequence[cst.BaseStatement]) -> BlockEdit | None:
        found = _relpos_pattern(self, stmts)
        if found is None:
            return None
        gathers, accs, acc_name, scale = found
        spans = [self.stmt_lines(stmts, j, j) for j in [*(g[0] for g in gathers), *(a for a in accs)]]
        last = accs[-1]
        anchor = stmts[last].body[0]  # type: ignore[attr-defined]
        if not self._wants(spans, RELPOS_GATHER, anchor):
            return None
        c2p = next((g for g in gathers if not g[4]), None)
        p2c = next((g for g in gathers if g[4]), None)
        none = cst.Name("None")
        new_value = cst.Call(
            self.ref(f"{KERNELS}.disentangled_bias"),
            [
                cst.Arg(c2p[2] if c2p else none, comma=_comma()),
                cst.Arg(p2c[2] if p2c else none, comma=_comma()),
                cst.Arg(c2p[3] if c2p else none, comma=_comma()),
                cst.Arg(p2c[3] if p2c else none, comma=_comma()),
                cst.Arg(scale),
            ],
        )
        new_stmt = cst.Assign(targets=[cst.AssignTarget(cst.Name(acc_name))], value=new_value)
        self.record_change(anchor, f"relative-position gathers and scaling -> {code(new_value.func)}")
        removed = frozenset({*(g[0] for g in gathers), *accs[:-1]})
        carried = [n for g in gathers for n in (g[2], g[3])] + [scale]
        return BlockEdit(last, last, {id(anchor): new_stmt}, carried=carried, removed=removed)

    # ---- 4: regional compilation --------------------------------------------------------------------------------
    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        if self.targets is None or self.RANDOM_ONLY:
            return updated_node
        done = self._decorate_caller(original_node, updated_node)
        if done is not None:
            return done
        start, end = self.lines_of(original_node)
        mine = [
            i
            for i, t in enumerate(self.targets)
            if i not in self.served
            and start <= t.line
            and t.end_line <= end
            and not self._in_nested(original_node, t)
        ]
        if not mine:
            return updated_node
        self.served.update(mine)
        why = self._cannot_compile(original_node)
        if why is not None:
            self.skip(original_node, f"not compiled on its own: {why}")
            return updated_node
        deco = cst.Decorator(decorator=self.ref(COMPILE_REGION))
        self.record_change(
            original_node,
            f"{original_node.name.value} compiled on its own: @{code(deco.decorator)} (regional torch.compile)",
        )
        self.targets_only += 1
        return updated_node.with_changes(decorators=[*updated_node.decorators, deco])

    def _decorate_caller(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef | None:
        """The caller of an autograd.Function holding a region, decorated (see `_compile_callers`)."""
        wanted = self.compile_with.get(id(original))
        if not wanted:
            return None
        line = self.lines_of(original)[0]
        cls = self._class_of(original)
        qualname = f"{cls.name.value}.{original.name.value}" if cls is not None else original.name.value
        why = self._cannot_compile(original)
        for target_line, name in wanted:
            if why is not None:
                self.skipped.append(
                    Note(target_line, f"not compiled with its caller {original.name.value}: {why}")
                )
            else:
                self.changes.append(Note(target_line, f"{name} (an autograd.Function) compiled with its caller: "
                                         f"{qualname} (line {line}) gets @compile_region"))  # fmt: skip
        if why is not None:
            return updated
        self.targets_only += len(wanted)
        deco = cst.Decorator(decorator=self.ref(COMPILE_REGION))
        return updated.with_changes(decorators=[*updated.decorators, deco])

    def _in_nested(self, fn: cst.FunctionDef, target: Target) -> bool:
        """Whether a function nested in `fn` holds the target (then that one is compiled)."""
        for inner in nodes_of(fn.body, cst.FunctionDef):
            a, b = self.lines_of(inner)
            if a <= target.line and target.end_line <= b:
                return True
        return False

    def _cannot_compile(self, fn: cst.FunctionDef) -> str | None:
        for deco in fn.decorators:
            names = qualified(self, deco.decorator) | {code(deco.decorator)}
            if any(n == COMPILE_REGION or n.endswith("compile_region") for n in names):
                return "it is already decorated with compile_region"
        if nodes_of(fn.body, cst.Yield):
            return "it is a generator (torch.compile compiles functions that return)"
        step = _training_step_call(fn)
        if step is not None:
            return (
                f"it runs the training step itself ({step}): compiling the loop would trace the optimizer "
                "and recompile every step; the model's forward is the region to compile"
            )
        cls = self._class_of(fn)
        if cls is not None and any(qualified(self, b.value) & AUTOGRAD_FUNCTION for b in cls.bases):
            why = self.plan.refused.get(cls.name.value)
            tail = f" ({why})" if why else ""
            return (
                f"it is part of the autograd.Function {cls.name.value}{tail}: compile the code that calls it"
            )
        return None

    def _class_of(self, fn: cst.FunctionDef) -> cst.ClassDef | None:
        from opadvisor.rewrite.toolkit import enclosing_class

        try:
            return enclosing_class(self, fn)
        except KeyError:
            return None


class RandomOnlyCodemod(FuseRegionCodemod):
    """The dropout rewrites alone: what verify's parity phase runs as the original (see the engine's
    `_parity_original`), so that the original's hand-written dropout is neutralised like the rewrite's."""

    RULE = "fuse_region (parity original)"  # not the rule's codemod: apply never picks it by name
    RANDOM_ONLY = True


FuseRegionCodemod.PARITY_BASELINE = RandomOnlyCodemod  # type: ignore[attr-defined]


# ---- helpers ----------------------------------------------------------------------------------------------------


_STEP_CALLS = frozenset({"backward", "step", "zero_grad"})


def _training_step_call(fn: cst.FunctionDef) -> str | None:
    """The first `loss.backward()` / `optimizer.step()` / `optimizer.zero_grad()` call in `fn`, as written: a
    function that trains (a script's `main`, its loop) is no region to compile."""
    for call in nodes_of(fn.body, cst.Call):
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in _STEP_CALLS:
            return f"`{code(call.func)}()`"
    return None


def _comma() -> cst.Comma:
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def _equal() -> cst.AssignEqual:
    return cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
    )


def _preorder(root: cst.CSTNode) -> list[cst.CSTNode]:
    out: list[cst.CSTNode] = []

    class _All(Visitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, (cst.Lambda, cst.FunctionDef)):
                return False
            out.append(node)
            return True

    root.visit(_All())
    return out


def _reads(stmt: cst.CSTNode, text: str, skip: set[int]) -> bool:
    """Whether `stmt` reads the name (or attribute text) `text`, outside the nodes in `skip`."""
    if "." in text:
        return any(code(a) == text and id(a) not in skip for a in nodes_of(stmt, cst.Attribute))
    return any(n.value == text and id(n) not in skip for n in nodes_of(stmt, cst.Name))


def _apply_of(node: cst.CSTNode) -> str | None:
    """`C` for a call `C.apply(...)`, else None."""
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "apply"
        and isinstance(node.func.value, cst.Name)
    ):
        return node.func.value.value
    return None


def _substitute(expr: cst.BaseExpression, by_name: dict[str, cst.BaseExpression]) -> cst.BaseExpression:
    class _Sub(Transformer):
        def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
            return by_name.get(updated.value, updated)

    if isinstance(expr, cst.Name) and expr.value in by_name:
        return by_name[expr.value]
    return expr.visit(_Sub())  # type: ignore[return-value]


def _params(fn: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in fn.params.params]


def _return_value(fn: cst.FunctionDef) -> tuple[int, cst.BaseExpression] | None:
    """(index, value) of the last statement of fn's body when it is `return value`."""
    body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else []
    if not body:
        return None
    last = body[-1]
    if (
        isinstance(last, cst.SimpleStatementLine)
        and len(last.body) == 1
        and isinstance(last.body[0], cst.Return)
    ):
        value = last.body[0].value
        return (len(body) - 1, value) if value is not None else None
    return None


def _verify_dropout_function(
    codemod: FuseRegionCodemod, forward: cst.FunctionDef, backward: cst.FunctionDef
) -> _DropoutFunction | str:
    """The Function's dropout facts, or why it is not a dropout this rewrite can replace."""
    fparams = _params(forward)
    got = _return_value(forward)
    if len(fparams) < 2 or got is None:
        return "its forward does not end in `return <expression>`"
    at, value = got
    fstmts = list(forward.body.body)  # type: ignore[union-attr]
    fres = Resolver(fstmts, at)
    dm = DropoutMatcher(codemod, fres.resolve).match(value)
    if dm is None:
        return "its forward is not a dropout this rewrite reads (a rand/bernoulli mask, masked_fill or a multiply, 1/(1-p))"
    params = fparams[1:]
    if not isinstance(dm.x, cst.Name) or dm.x.value not in params:
        return "the tensor it drops is not one of its inputs"
    if any(n.value not in params for n in names_in(dm.p)):
        return f"its probability ({dm.p_text}) is not computed from its inputs"
    saved = _saved_for_backward(fstmts)
    bres = _BackwardResolver(backward, fstmts, saved, at)
    bparams = _params(backward)
    got_b = _return_value(backward)
    if len(bparams) != 2 or got_b is None:
        return "its backward does not take one gradient and return the input gradients"
    elems = _tuple_elements(got_b[1])
    if len(elems) != len(params):
        return "its backward does not return one gradient per input"
    x_index = params.index(dm.x.value)
    if any(not (isinstance(e, cst.Name) and e.value == "None") for i, e in enumerate(elems) if i != x_index):
        return "its backward returns gradients for inputs other than the dropped tensor"
    bm = DropoutMatcher(codemod, bres.resolve).match(elems[x_index], same_shape=dm.x.value)
    if bm is None or not isinstance(bm.x, cst.Name) or bm.x.value != bparams[1]:
        return "its backward does not apply the mask and scale to the gradient"
    if bm.p_text != dm.p_text or not bres.used_saved:
        return "its backward does not use the mask its forward saved"
    if fres.stale or bres.stale:
        return "it reads a name it rebinds in between (`x = x...`), which this rewrite does not follow"
    return _DropoutFunction(params, x_index, dm.p)


def _tuple_elements(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(node, cst.Tuple):
        return [e.value for e in node.elements]
    return [node]


def _saved_for_backward(stmts: Sequence[cst.BaseStatement]) -> tuple[int, list[cst.BaseExpression]] | None:
    """(statement index, arguments) of the forward's `ctx.save_for_backward(...)`."""
    for j, stmt in enumerate(stmts):
        for call in nodes_of(stmt, cst.Call):
            f = call.func
            if isinstance(f, cst.Attribute) and f.attr.value == "save_for_backward":
                return j, [a.value for a in call.args]
    return None


class _BackwardResolver:
    """Names in the backward that come from `ctx.saved_tensors` resolve to what the forward saved; `ctx.attr`
    to what the forward assigned it; everything through the forward's own temporaries. A node inside a
    value already followed is looked up by the resolver that returned it (relative to its binding)."""

    def __init__(self, backward: cst.FunctionDef, fstmts, saved, f_at: int) -> None:
        self.saved = saved
        self.from_saved: dict[str, int] = {}
        self.used_saved = False
        body = backward.body.body if isinstance(backward.body, cst.IndentedBlock) else []
        bstmts = list(body)
        self.forward = Resolver(fstmts, f_at)  # ctx.attr: what the forward assigned
        self.at_save = Resolver(fstmts, saved[0]) if saved is not None else None
        self.backward = Resolver(bstmts, len(bstmts) - 1)
        for stmt in bstmts:
            self._note_saved(stmt)

    @property
    def stale(self) -> bool:
        resolvers = (self.forward, self.at_save, self.backward)
        return any(r is not None and r.stale for r in resolvers)

    def _note_saved(self, stmt: cst.BaseStatement) -> None:
        """`a, b = ctx.saved_tensors` / `a = ctx.saved_tensors[0]`: which saved tensor each name is."""
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            return
        small = stmt.body[0]
        if not isinstance(small, cst.Assign) or len(small.targets) != 1:
            return
        target, val = small.targets[0].target, small.value
        if isinstance(val, cst.Attribute) and val.attr.value == "saved_tensors":
            if isinstance(target, (cst.Tuple, cst.List)):
                for i, el in enumerate(target.elements):
                    if isinstance(el.value, cst.Name):
                        self.from_saved[el.value.value] = i
        elif (
            isinstance(val, cst.Subscript)
            and isinstance(val.value, cst.Attribute)
            and val.value.attr.value == "saved_tensors"
            and isinstance(target, cst.Name)
            and len(val.slice) == 1
            and isinstance(val.slice[0].slice, cst.Index)
            and isinstance(val.slice[0].slice.value, cst.Integer)
        ):
            self.from_saved[target.value] = int(val.slice[0].slice.value.value)

    def resolve(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        for resolver in (self.at_save, self.forward):
            if resolver is not None and resolver.owns(node):  # read inside a forward value
                return resolver.resolve(node)
        text = code(node)
        if text in self.from_saved and self.saved is not None:
            _, args = self.saved
            i = self.from_saved[text]
            if i < len(args):
                self.used_saved = True
                saved = args[i]
                if isinstance(saved, cst.Name):
                    return self.at_save.resolve(saved) or None  # type: ignore[union-attr]
                return saved
            return None
        if isinstance(node, cst.Attribute):
            return self.forward.resolve(node)
        return self.backward.resolve(node)


def _gather_of(codemod: FuseRegionCodemod, value: cst.BaseExpression):
    """(source table, index before .expand, transposed) for `torch.gather(S, dim=-1, index=I.expand(...))`
    with an optional `.transpose(-1, -2)`, else None."""
    transposed = False
    if (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and value.func.attr.value == "transpose"
        and [code(a.value) for a in value.args] in (["-1", "-2"], ["-2", "-1"])
    ):
        value, transposed = value.func.value, True
    if not (isinstance(value, cst.Call) and "torch.gather" in qualified(codemod, value.func)):
        return None
    from opadvisor.rewrite.toolkit import bind_args, int_value

    args = bind_args(value, ("input", "dim", "index"), required=3)
    if args is None or int_value(args["dim"].value) != -1:
        return None
    index = args["index"].value
    if not (
        isinstance(index, cst.Call)
        and isinstance(index.func, cst.Attribute)
        and index.func.attr.value == "expand"
    ):
        return None
    return args["input"].value, index.func.value, transposed


def _relpos_pattern(codemod: FuseRegionCodemod, stmts: Sequence[cst.BaseStatement]):
    """([(stmt, name, table, index, transposed)], [accumulation stmts], accumulator, scale) or None."""
    gathers = []
    for j, stmt in enumerate(stmts):
        binding = simple_binding(stmt)
        if len(binding) == 1:
            ((name, value),) = binding.items()
            g = _gather_of(codemod, value) if "." not in name else None
            if g is not None:
                gathers.append((j, name, *g))
    if not gathers or len(gathers) > 2 or (len(gathers) == 2 and gathers[0][4] == gathers[1][4]):
        return None
    accs: list[int] = []
    acc_name = scale = None
    for g in gathers:
        found = _accumulation(stmts, g[0], g[1])
        if found is None:
            return None
        j, target, divisor, augmented = found
        if (acc_name is not None and target != acc_name) or (
            scale is not None and code(divisor) != code(scale)
        ):
            return None
        if augmented != bool(accs):  # `score = A / s` first, `score += B / s` after
            return None
        acc_name, scale = target, divisor
        accs.append(j)
    removed = {g[0] for g in gathers} | set(accs[:-1])
    for g in gathers:  # nothing else reads the gathered tensors; nothing in between rebinds the inputs
        if any(
            _reads(stmts[i], g[1], set())
            for i in range(g[0] + 1, len(stmts))
            if i not in removed and i not in accs
        ):
            return None
        inputs = {n.value for n in names_in(g[2])} | {n.value for n in names_in(g[3])}
        between = [i for i in range(g[0] + 1, accs[-1]) if i not in removed]
        if any(inputs & block_index(stmts).binds[i] for i in between):
            return None
    if any(_reads(stmts[i], acc_name, set()) for i in range(accs[0] + 1, accs[-1]) if i not in removed):
        return None
    return gathers, accs, acc_name, scale


def _accumulation(stmts, after: int, name: str):
    """(stmt, accumulator, divisor, augmented) of the first `acc = name / s` or `acc += name / s` after."""
    for j in range(after + 1, len(stmts)):
        stmt = stmts[j]
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            continue
        small = stmt.body[0]
        if (
            isinstance(small, cst.Assign)
            and len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name)
        ):
            target, value, augmented = small.targets[0].target.value, small.value, False
        elif (
            isinstance(small, cst.AugAssign)
            and isinstance(small.operator, cst.AddAssign)
            and isinstance(small.target, cst.Name)
        ):
            target, value, augmented = small.target.value, small.value, True
        else:
            continue
        if (
            isinstance(value, cst.BinaryOperation)
            and isinstance(value.operator, cst.Divide)
            and isinstance(value.left, cst.Name)
            and value.left.value == name
        ):
            return j, target, value.right, augmented
        if _reads(stmt, name, set()):
            return None
    return None


def _activation_call(func: cst.BaseExpression, x: cst.BaseExpression, keywords) -> cst.Call:
    """The activation's call on x with the declaration's keyword arguments (`approximate="tanh"`)."""
    kw = [cst.Arg(cst.parse_expression(v), keyword=cst.Name(k), equal=_equal()) for k, v in keywords]
    return cst.Call(func, [cst.Arg(x, comma=_comma()) if kw else cst.Arg(x), *kw])

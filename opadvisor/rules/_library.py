"""Findings in library code: rules see where each op's code is written; the finding says whose code it is.

The profile gives each op the innermost user frame (`file`, `line`) and, when the op was issued inside an
installed library the user's code called, the innermost library frame (`lib_file`, `lib_line`,
`lib_function`). A pattern lives where its ops are issued, so the rules run on a *view* of the profile
in which an op issued in library code carries the library's place in `file` / `line` / `function` (the
installed file's absolute path), and so do constructions a library made (an nn.Linear built in
`BertLMPredictionHead.__init__`). Every rule then finds and pinpoints library patterns as it does user
code, reading the library's source to confirm them, and never names the user's `model(...)` line as the
place of a softmax it did not write.

    view = pattern_view(profile)          # what the engine hands to the rules (cached on the profile)
    describe_library(finding, view)       # after detect: `finding.library`, the message, the fix

`describe_library` fills `Finding.library` for a finding whose file is library code: the package, its
version, the path within site-packages and lines, the function, the module class whose code holds the
pattern, where the user's code called it, where the script built the model, and the fix for library code
that applies (opadvisor/libraries.py: a library switch or `opadvisor.patch`), or none with the reason.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import libcst as cst

from opadvisor.libraries import (
    HF_ATTENTION_CLASSES,
    LOADERS,
    LibraryFix,
    block_of,
    fixes_for,
    repeated_blocks,
)
from opadvisor.profile.model import Construction, Op, Profile
from opadvisor.rules._source import load_source
from opadvisor.rules.facts import facts_class
from opadvisor.rules.finding import Finding

__all__ = ["describe_library", "library_path", "library_view_path", "pattern_view"]

_VIEW = "_opadvisor_pattern_view"

# torch.nn classes that are operators, not model code: the module that calls them owns the pattern
_TORCH_MODEL_CLASSES = ("MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer")


@dataclasses.dataclass
class _Site:
    """What ran at one library line: who called it from user code, and in which module classes."""

    calls: Counter = dataclasses.field(default_factory=Counter)  # (user file, line) -> ops
    owners: Counter = dataclasses.field(default_factory=Counter)  # qualified class -> ops


@dataclasses.dataclass
class _LibraryIndex:
    files: dict[str, str]  # absolute (or package-relative) path in the view -> path within site-packages
    sites: dict[str, dict[int, _Site]]  # view path -> line -> site
    models: list[Construction]


def library_path(profile: Profile, rel: str) -> str:
    """The installed file of a library path (`transformers/models/bert/modeling_bert.py`): where it was
    when profiled, else where the package is now; the path within site-packages when neither exists."""
    package = rel.split("/", 1)[0].removesuffix(".py")
    root = (profile.libraries.get(package) or {}).get("root")
    if root and (Path(root) / rel).is_file():
        return str(Path(root) / rel)
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        base = (
            Path(spec.origin).parent.parent if spec.submodule_search_locations else Path(spec.origin).parent
        )
        if (base / rel).is_file():
            return str(base / rel)
    return rel


def pattern_view(profile: Profile) -> Profile:
    """The profile as rules read it (see the module docstring); the profile itself when no op ran in a
    library. Cached on the profile."""
    cached = profile.__dict__.get(_VIEW)
    if cached is not None:
        return cached
    if not any(op.lib_file for op in profile.ops) and not any(c.lib_file for c in profile.constructions):
        profile.__dict__[_VIEW] = profile
        return profile
    paths = {rel: library_path(profile, rel) for rel in _library_files(profile)}
    ops = [_located(op, paths) for op in profile.ops]
    constructions = [_located_construction(c, paths) for c in profile.constructions]
    sources = dict(profile.sources)
    for rel, path in paths.items():
        if rel in profile.library_sources:
            sources[path] = profile.library_sources[rel]
    view = dataclasses.replace(profile, ops=ops, constructions=constructions, sources=sources)
    view.__dict__[_VIEW] = view
    view.__dict__["_opadvisor_library_index"] = _index(profile, view, paths)
    profile.__dict__[_VIEW] = view
    return view


def library_view_path(view: Profile, rel: str) -> str | None:
    """The path under which the pattern view holds library file `rel` (path within site-packages), or None
    when no op or construction of the profile ran there."""
    index: _LibraryIndex | None = view.__dict__.get("_opadvisor_library_index")
    if index is None:
        return None
    return next((path for path, r in index.files.items() if r == rel), None)


def _library_files(profile: Profile) -> set[str]:
    files = {op.lib_file for op in profile.ops if op.lib_file}
    return files | {c.lib_file for c in profile.constructions if c.lib_file}


def _located(op: Op, paths: dict[str, str]) -> Op:
    if not op.lib_file:
        return op
    return dataclasses.replace(
        op,
        file=paths[op.lib_file],
        line=op.lib_line,
        line_exact=op.lib_line_exact,
        function=_pattern_function(op.lib_function),
    )


def _pattern_function(function: str | None) -> str | None:
    """The function a library op's pattern is read in: a private helper method of a library class
    (`TransformerEncoderLayer._ff_block`, whose dropout the caller's `forward` adds to the residual) counts
    as part of that class's `forward`. A library pattern is fixed by replacing the module's forward (a
    patch), never by editing the helper, so a chain that crosses into the helper is one pattern; the
    op keeps its own line."""
    if not function or "." not in function:
        return function
    cls, _, method = function.rpartition(".")
    if method.startswith("_") and not method.startswith("__"):
        return f"{cls}.forward"
    return function


def _located_construction(c: Construction, paths: dict[str, str]) -> Construction:
    if not c.lib_file:
        return c
    return dataclasses.replace(c, file=paths[c.lib_file], line=c.lib_line, function=c.lib_function)


def _index(profile: Profile, view: Profile, paths: dict[str, str]) -> _LibraryIndex:
    sites: dict[str, dict[int, _Site]] = defaultdict(lambda: defaultdict(_Site))
    for user_op, op in zip(profile.ops, view.ops, strict=True):
        if not user_op.lib_file or op.line is None or op.is_backward:
            continue
        site = sites[op.file][op.line]
        if user_op.file is not None and user_op.line is not None:
            site.calls[(user_op.file, user_op.line)] += 1
        owner = _owner_class(view, op)
        if owner is not None:
            site.owners[owner] += 1
    for user_c, c in zip(profile.constructions, view.constructions, strict=True):
        if user_c.lib_file and c.line is not None and user_c.file and user_c.line:
            sites[c.file][c.line].calls[(user_c.file, user_c.line)] += 1
    models = [c for c in profile.constructions if c.kind == "model"]
    return _LibraryIndex({path: rel for rel, path in paths.items()}, sites, models)


def _owner_class(view: Profile, op: Op) -> str | None:
    """The qualified class of the module whose code issued `op`: the class named in its function
    ("BertSelfOutput.forward"), else the innermost module that is not one of torch.nn's operators."""
    cls = op.function.split(".", 1)[0] if op.function and "." in op.function else None
    path = op.module
    chain = []
    while path is not None:
        chain.append(path)
        path = path.rpartition(".")[0] if path else None
    for p in chain:
        qualified = view.modules.get(p) or (op.module_type if p == op.module else None)
        if qualified is None:
            continue
        short = qualified.rsplit(".", 1)[-1]
        if cls is not None:
            if short == cls:
                return qualified
        elif not qualified.startswith("torch.nn.modules.") or short in _TORCH_MODEL_CLASSES:
            return qualified
    return op.module_type


# ---- describing a finding ------------------------------------------------------------------------------


def describe_library(finding: Finding, view: Profile) -> None:
    """Fill `finding.library` (and its message, fix and advice) when its file is library code."""
    index: _LibraryIndex | None = view.__dict__.get("_opadvisor_library_index")
    if index is None or finding.path not in index.files:
        return
    rel = index.files[finding.path]
    package = rel.split("/", 1)[0].removesuffix(".py")
    calls: Counter = Counter()
    owners: Counter = Counter()
    for line, site in index.sites.get(finding.path, {}).items():
        if finding.line <= line <= finding.end_line:
            calls.update(site.calls)
            owners.update(site.owners)
    owner = owners.most_common(1)[0][0] if owners else _module_class(view, finding)
    call = calls.most_common(1)[0][0] if calls else None
    model = index.models[0] if index.models else None
    fix = _choose_fix(finding, owner, model, call, timm_switch(finding.path, owner), _block(view, finding))
    finding.library = {
        "package": package,
        "version": (view.libraries.get(package) or {}).get("version"),
        "file": rel,
        "line": finding.line,
        "end_line": finding.end_line,
        "function": finding.function,
        "module_class": owner,
        "called_from": {"path": call[0], "line": call[1]} if call else None,
        "model": _model_entry(model),
        "fix": fix,
    }
    finding.message += _where_words(finding, rel, owner, call)
    if fix["kind"] == "none" and finding.advice:  # the rule's own advice still says what would help
        fix["advice"] += f"; {finding.advice}"
    finding.fix = fix["safety"]
    finding.advice = fix["advice"]


def _module_path(finding: Finding) -> str | None:
    """The module the pattern ran in: the one its facts name (a block's, a cell's), else the finding's."""
    facts_type = facts_class(finding.rule)
    module = getattr(finding.facts(facts_type), "module", None) if facts_type is not None else None
    return module if isinstance(module, str) else finding.module


def _module_class(view: Profile, finding: Finding) -> str | None:
    module = _module_path(finding)
    return view.modules.get(module) if module is not None else None


def _block(view: Profile, finding: Finding) -> str | None:
    """The repeated library block (BertLayer) the finding's module is or runs inside, by its module path."""
    blocks = repeated_blocks(view.modules, lambda cls: cls.split(".", 1)[0] in view.libraries)
    return blocks.get(block_of(_module_path(finding), blocks) or "")


def _model_entry(model: Construction | None) -> dict[str, Any] | None:
    if model is None:
        return None
    return {
        "path": model.file,
        "line": model.line,
        "cls": model.cls,
        "how": model.attrs.get("how"),
        "attn_implementation": model.attrs.get("attn_implementation"),
    }


def _where_words(finding: Finding, rel: str, owner: str | None, call: tuple[str, int] | None) -> str:
    lines = f"{finding.line}" + (f"-{finding.end_line}" if finding.end_line != finding.line else "")
    function = finding.function or "library code"
    short = owner.rsplit(".", 1)[-1] if owner else None
    of = f" of {short}" if short and not function.startswith(short + ".") else ""
    called = f", called from {Path(call[0]).name}:{call[1]}" if call else ""
    return f"; in {function}{of} ({rel}:{lines}){called}"


def _choose_fix(
    finding: Finding,
    owner: str | None,
    model: Construction | None,
    call: tuple[str, int] | None,
    timm: str | None = None,
    block: str | None = None,
) -> dict[str, Any]:
    """The fix for library code that applies to this finding, or kind "none" with the reason."""
    reasons: list[str] = []
    for fix in fixes_for(owner, finding.rule):
        reason = _not_applicable(fix, model, call, timm, block, finding, owner)
        if reason is None:
            return _fix_entry(fix, model, call)
        reasons.append(f"{fix.name}: {reason}")
    if not reasons:
        short = owner or "this library code"
        reasons.append(f"opadvisor has no fix for {finding.rule} in {short}")
    return {
        "kind": "none",
        "name": None,
        "safety": "none",
        "summary": None,
        "rules": [],
        "advice": "in library code: " + "; ".join(reasons),
    }


def _not_applicable(
    fix: LibraryFix,
    model: Construction | None,
    call: tuple[str, int] | None,
    timm: str | None = None,
    block: str | None = None,
    finding: Finding | None = None,
    owner: str | None = None,
) -> str | None:
    if fix.name == "compile_blocks" and block is None:
        return "the code does not run inside a repeated library block (a library class with two or more instances)"
    if fix.name in TIMM_SWITCHES:
        want = TIMM_SWITCHES[fix.name]
        if timm is None:
            return "the module does not read timm's fused_attn switch (timm.layers.use_fused_attn) when it is built"
        if timm != want:
            return f"the module's switch is timm's {timm} one"
    if fix.where == "model" and (model is None or model.file is None):
        return "the profile did not record where the script built the model"
    if fix.where == "call" and call is None:
        return "the profile did not record where the script called into the library"
    if fix.name in ("hf_attn_implementation", "hf_attn_switch"):
        return _hf_switch_problem(fix, model, finding, owner)
    return None


def _hf_switch_problem(
    fix: LibraryFix, model: Construction | None, finding: Finding | None, owner: str | None
) -> str | None:
    """Why transformers' attention switch (written as a literal, or set by opadvisor.patch) does not fix
    this finding: the model runs another attention, is not transformers', the pattern is not the attention
    the switch replaces, or (the literal) the script computes the value where it builds the model."""
    assert model is not None  # fix.where == "model": checked by the caller
    attn = model.attrs.get("attn_implementation")
    if attn != "eager":
        return f"the model's attn_implementation is {attn!r}, not 'eager'"
    if model.attrs.get("package") != "transformers":
        return "the model is not a transformers model"
    if owner not in HF_ATTENTION_CLASSES:
        function = (finding.function or "") if finding is not None else ""
        if not function.endswith("eager_attention_forward"):
            return "the pattern is not transformers' eager attention (eager_attention_forward)"
        if model.attrs.get("supports_sdpa") is not True:
            return f"{model.cls.rsplit('.', 1)[-1]} does not support attn_implementation='sdpa'"
    computed = computed_attn_argument(model.file, model.line)
    if fix.name == "hf_attn_implementation" and computed is not None:
        return f"attn_implementation={computed} is computed where the model is built"
    if fix.name == "hf_attn_switch" and computed is None:
        return "the switch can be written where the model is built (hf_attn_implementation)"
    return None


def computed_attn_argument(path: str | None, line: int | None) -> str | None:
    """The source of a non-literal `attn_implementation=` argument (or of `**kwargs` that may carry it) in
    the statement at `path:line`; None when it is a string literal or absent."""
    src = load_source(path) if path is not None and line is not None else None
    if src is None:
        return None
    first, last = src.statement_span(line)
    for site in src.calls(first, last):
        for arg in site.node.args:
            keyword = arg.keyword.value if arg.keyword is not None else None
            if keyword == "attn_implementation" and not isinstance(arg.value, cst.SimpleString):
                return cst.Module([]).code_for_node(arg.value)
            if arg.star == "**" and site.attr in LOADERS:
                return "**" + cst.Module([]).code_for_node(arg.value)
    return None


# timm's fused attention switch (timm.layers.config): a module sets `self.fused_attn = use_fused_attn()`
# in its __init__ (on unless TIMM_FUSED_ATTN=0 or set_fused_attn(False)), or `use_fused_attn(experimental=
# True)` for the modules timm has not vouched for (Swin's WindowAttention, XCiT, ...: off by default).
# `set_fused_attn(True[, experimental=True])` before the model is built turns them on.
TIMM_SWITCHES = {"timm_fused_attn": "tested", "timm_fused_attn_experimental": "experimental"}


def timm_switch(path: str, owner: str | None) -> str | None:
    """ "tested" / "experimental": how the __init__ of timm class `owner` (defined in the installed file
    `path`, where the pattern is) reads timm's fused_attn switch; None when it does not, or is no timm class."""
    if owner is None or not owner.startswith("timm."):
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    name = owner.rsplit(".", 1)[-1]
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and cls.name == name):
            continue
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            sets = any(isinstance(t, ast.Attribute) and t.attr == "fused_attn" for t in node.targets)
            if called == "use_fused_attn" and sets:
                experimental = any(
                    k.arg == "experimental" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.value.keywords
                )
                return "experimental" if experimental else "tested"
    return None


def finding_rule(fix: LibraryFix) -> str:
    return fix.rules[0]


def _fix_entry(fix: LibraryFix, model: Construction | None, call: tuple[str, int] | None) -> dict[str, Any]:
    at = f"{Path(model.file).name}:{model.line}" if model is not None and model.file else "the model's line"
    if fix.kind == "rule":
        where = Path(call[0]).name if call else "the script"
        advice = f"{fix.summary}: `opadvisor apply --rule {finding_rule(fix)}` writes it in {where}"
    elif fix.kind == "patch":
        advice = (
            f"{fix.summary}: `opadvisor apply` inserts `model = opadvisor.patch(model, rules=[...])` after "
            f"{at}, where the script builds the model"
        )
    elif fix.where == "call":
        advice = f"{fix.summary}: `opadvisor apply` writes it at the call"
    else:
        advice = f"{fix.summary}: `opadvisor apply` writes it at {at}"
    return {
        "kind": fix.kind,
        "name": fix.name,
        "safety": fix.safety,
        "summary": fix.summary,
        "rules": list(fix.rules),
        "advice": advice,
        # what `opadvisor.patch(model, rules=[...])` is given: the finding's rule, or the fix's own name for
        # one chosen only by name (compile_blocks)
        **({"select": fix.name} if fix.opt_in else {}),
    }

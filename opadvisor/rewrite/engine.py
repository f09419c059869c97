"""The rewrite engine behind `opadvisor apply`: pick targets, run codemods, check, diff, write, back up, undo.

Two modes:

- profile mode (`apply_findings`, behind `check.apply_run`): the findings of a rule in a run (default: the latest) name files and line
  ranges; each file's codemod runs restricted to those ranges (`Target`s). A file is refused when its
  sha256 differs from the one the profile recorded (its lines may have moved; `--force` overrides), when
  it lies outside the project (the current directory) or inside site-packages. A file that an earlier
  `apply` of the same run rewrote is accepted when it is exactly what that apply wrote; the findings'
  lines (which refer to the profiled original) are mapped onto it through a line diff.
- static mode (`apply_files`): the named files, every match (no profile, no hash to check).

For every file: parse (a file that does not parse is an error: nothing is written), run the codemod,
re-parse and compile the result, run the codemod again on it (it must not change anything a second time:
otherwise the rewrite is not stable and nothing is written), and produce a unified diff. Refusals and
errors are checked for every file before anything is written, so an apply either writes all its files
or none.

Writing: each file is replaced atomically (a temporary file beside it, then rename; its permission bits
kept), after a byte-exact backup of what it was:
- profile mode: `<run>/backup/<path relative to the project>`, recorded in `<run>/applied.json`
  (`{"schema": 1, "applied": [{"rule", "path", "backup", "sha256_before", "sha256_after", "after",
  "changes": [{"line", "message"}]}]}`, one entry per file per rule per apply, appended). The first
  backup of a file is kept: a later apply to the same file (another rule) records it again as that file's
  original, so `backup` always holds the file as profiled. `after` (added later; older entries lack it)
  is `snapshots/<entry index>/<path>`, the file as that entry's rule left it: `verify` rebuilds the
  program with only the first rules applied from these, to time each rule. When a rule's codemod has a
  PARITY_BASELINE twin (rewrites that swap one random stream for another), the original with the twin's
  rewrites goes to `<run>/parity/<path>` and the entries name it ("parity_original"): verify's parity phase
  runs that.
- static mode: the same layout under `.opadvisor/static/` (`applied.json` + `backup/`).

`undo` restores every file recorded in a run's (or the static) applied.json to its backup, byte for byte,
refusing a file edited since the apply wrote it (unless forced), then drops those entries and backups.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import libcst as cst
from libcst.codemod import CodemodContext, SkipFile

from opadvisor.errors import UserError
from opadvisor.files import atomic_write
from opadvisor.profile.runs import profiled_source
from opadvisor.rewrite import _budget, _merge, _metadata, _relevance, base, registry
from opadvisor.rewrite.base import Note, RuleCodemod, Target, finding_target
from opadvisor.rewrite.library import LibraryFixFacts

APPLIED_FILE = "applied.json"
APPLIED_SCHEMA = 1
BACKUP_DIR = "backup"
PARITY_DIR = "parity"  # the original as verify's parity run sees it, when a rule asks (PARITY_BASELINE)
SNAPSHOT_DIR = "snapshots"  # the file after each entry (applied.json's "after"), for verify's per-rule times
STATIC_DIR = "static"  # .opadvisor/static: applied.json and backup/ of static-mode applies
EDITED_SINCE_PROFILE = (
    "an edit since the profile"  # who moved the lines of a file `--force` places findings on
)


# ---- results --------------------------------------------------------------------------------------------
@dataclass
class RuleResult:
    rule: str
    changes: list[Note] = field(default_factory=list)
    skipped: list[Note] = field(default_factory=list)  # matched sites left alone, with the reason
    notes: list[Note] = field(default_factory=list)  # display-only suggestions
    already: str | None = None  # the codemod found its own fix in place (why it says so)
    before: bytes = b""  # the file before and after this rule's pass
    after: bytes = b""


@dataclass
class FileResult:
    path: Path  # resolved absolute path
    before: bytes
    after: bytes
    rules: list[RuleResult] = field(default_factory=list)
    # the original with only the rewrites that swap one random stream for another (see _parity_original)
    parity_original: bytes | None = None

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self, base: Path | None = None) -> str:
        name = display_path(self.path, base)
        old = self.before.decode("utf-8", errors="surrogateescape").splitlines(keepends=True)
        new = self.after.decode("utf-8", errors="surrogateescape").splitlines(keepends=True)
        lines = list(difflib.unified_diff(old, new, f"a/{name}", f"b/{name}"))
        return "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
        )


@dataclass
class ApplyResult:
    files: list[FileResult]
    messages: list[str] = field(default_factory=list)  # findings not applied, and why (one line each)
    state_dir: Path | None = None  # where backups and applied.json went (or would go)
    written: bool = False

    @property
    def changed(self) -> list[FileResult]:
        return [f for f in self.files if f.changed]


# ---- small helpers ----------------------------------------------------------------------------------------
def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def display_path(path: Path, base: Path | None = None) -> str:
    base = (base or Path.cwd()).resolve()
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def project_root() -> Path:
    return Path.cwd().resolve()


def codemod_order(rules: Iterable[str]) -> list[str]:
    """Rules' codemods in the rule registry's order; the library fixes' codemods last (they insert next to
    the model's construction, which another rule may have rewritten)."""
    wanted = set(rules)
    ordered = [r for r in registry.fixable_rules() if r in wanted]
    return ordered + [r for r in registry.LIBRARY_CODEMODS if r in wanted]


def location_problem(path: Path, root: Path) -> str | None:
    """Why a file may not be rewritten because of where it is, or None."""
    # Only the folders below the project count: a project cloned into a folder named site-packages is not
    # installed code, a venv inside the project is.
    inside = path.is_relative_to(root)
    below = path.relative_to(root).parts if inside else path.parts
    if any(part in {"site-packages", "dist-packages"} for part in below):
        return f"{path} is inside site-packages (installed code, not this project's); not rewriting it"
    if not inside:
        return (
            f"{path} lies outside the project directory {root}; run opadvisor from the project that holds it"
        )
    return None


def _check_writable(path: Path) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path} is not a regular file")
    # root can write anything: judge by the permission bits, as a user would read them
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
        raise UserError(f"{path} is read-only; not rewriting it (make it writable first)")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write in {path.parent} (the rewrite replaces the file through a temporary one)"
        )


# ---- running one codemod on one source ---------------------------------------------------------------------
def _parse(source: bytes, path: Path | str) -> cst.Module:
    try:
        return _metadata.parse(source)  # once per text: its codemods share one metadata wrapper
    except cst.ParserSyntaxError as exc:
        raise UserError(
            f"{path}: cannot parse it (line {exc.raw_line}, column {exc.raw_column}: {exc.message}); nothing written"
        ) from None
    except (UnicodeDecodeError, SyntaxError, ValueError) as exc:
        raise UserError(f"{path}: cannot parse it ({exc}); nothing written") from None


def _run_once(
    codemod_cls: type[RuleCodemod],
    module: cst.Module,
    targets: Sequence[Target] | None,
    path: Path | str,
    allow_unsafe: bool = False,
    options: dict[str, Any] | None = None,
    source: bytes | None = None,
    defer_imports: bool = False,
) -> tuple[cst.Module, RuleCodemod]:
    """One pass of `codemod_cls` over `module`; a static one over a slim module where that saves time
    (`source`, the module's text, given: _slim_of). With `defer_imports` the imports it asks for are not
    added but kept in the codemod's `imports_asked`."""

    def make() -> RuleCodemod:
        codemod = codemod_cls(CodemodContext(filename=str(path)), targets, **(options or {}))
        # A codemod may do some rewrites only when unsafe fixes are allowed; it reads this attribute.
        codemod.allow_unsafe = allow_unsafe  # type: ignore[attr-defined]
        codemod.defer_imports = defer_imports
        return codemod

    codemod = make()
    try:
        found = _slim_of(codemod, module, source) if source is not None else None
        if found is not None:
            slim, originals = found
            back = _relevance.restored(codemod.transform_module(slim), originals)
            if back is not None:
                return (back if codemod.modified else module), codemod
            codemod = make()  # spent on a slim module that did not come back whole: the whole module
        new_module = codemod.transform_module(module)
        return (new_module if codemod.modified else module), codemod
    except SkipFile:
        return module, codemod
    except (UserError, _budget.OverBudget):
        raise
    except Exception as exc:  # a bug in a codemod must not write anything
        raise UserError(
            f"{path}: the {codemod_cls.RULE} rewrite failed ({type(exc).__name__}: {exc}); nothing written"
        ) from exc


@contextmanager
def unfiltered() -> Iterator[None]:
    """Static passes read every statement of every file inside this block (no SOURCE_WORDS filter, no slim
    module): what benchmarks/ecosystem.py --compare-filter holds the filtered passes to."""
    _relevance.ENABLED = False
    try:
        yield
    finally:
        _relevance.ENABLED = True


_MERGE = True  # sequential() clears it


@contextmanager
def sequential() -> Iterator[None]:
    """Inside this block a static `--rule all` runs each rule on the text the one before it left (no first
    round on the original, _first_round): what benchmarks/ecosystem.py --compare-merge holds it to."""
    global _MERGE
    _MERGE = False
    try:
        yield
    finally:
        _MERGE = True


@cache
def _static_words() -> tuple[str, ...]:
    """The SOURCE_WORDS of every codemod with a static pass (a definition none of them names none reads)."""
    words: dict[str, None] = {}
    for rule in registry.fixable_rules():
        codemod_cls = registry.get_codemod(rule)
        for cls in (codemod_cls, getattr(codemod_cls, "PARITY_BASELINE", None)):
            if cls is not None and cls.STATIC_MODE:
                if not cls.SOURCE_WORDS:
                    return ()  # one that reads every definition: no slim module
                words.update(dict.fromkeys(cls.SOURCE_WORDS))
    return tuple(words)


def _slim_of(
    codemod: RuleCodemod, module: cst.Module, source: bytes
) -> tuple[cst.Module, dict[int, cst.CSTNode]] | None:
    """The slim module of `source` (_relevance.slim_module: the definitions no static pass can match stood
    in for) and its stand-ins, for a static pass of `codemod`; None where the pass is to read the whole
    module: a profile's pass, a codemod without SOURCE_WORDS, metadata of the whole text at hand already,
    the filter off, or little to leave out."""
    if codemod.targets is not None or not codemod.SOURCE_WORDS or _metadata.resolved(module):
        return None
    # one slim module per text for every static pass over it, so that they share its metadata: it keeps
    # what any of them reads (each pass then skips what it does not: RuleCodemod.on_visit)
    words = _static_words()
    return _metadata.slim(source, words) if words and _relevance.ENABLED else None


def _no_static_pass(codemod_cls: type[RuleCodemod], source: bytes) -> bool:
    """Static mode has nothing for this codemod to do: it needs a profile, or the file names none of the
    words its matches name."""
    if not codemod_cls.STATIC_MODE:
        return True
    words = codemod_cls.SOURCE_WORDS
    return bool(words) and codemod_cls.NEEDS_WORDS and not _relevance.names_any(source, words)


def _result_of(rule: str, codemod: RuleCodemod, source: bytes, new_source: bytes) -> RuleResult:
    """What a pass of `rule` from `source` to `new_source` did."""
    changes = list(codemod.changes) if new_source != source else []  # said it changed, produced nothing
    notes = list(getattr(codemod, "notes", []))
    already = getattr(codemod, "already", None)
    return RuleResult(rule, changes, list(codemod.skipped), notes, already, source, new_source)


def rewrite_source(
    source: bytes,
    rule: str,
    targets: Sequence[Target] | None = None,
    path: Path | str = "<source>",
    allow_unsafe: bool = False,
    options: dict[str, Any] | None = None,
) -> tuple[bytes, RuleResult]:
    """Run `rule`'s codemod on `source` (restricted to `targets`, or every match when None).

    `options` are keyword arguments of the codemod's constructor (fp32_gemm's `mode`, say). Checks the
    result re-parses and compiles, and that the codemod is stable on it (a second run changes nothing it
    should not); raises UserError otherwise, and OverBudget when the analysis (all its passes) runs past
    the budget of `_budget.py`.
    """
    key = _memo_key(source, rule, targets, path, allow_unsafe, options)
    if key is not None and key in _REWRITES:
        return _recalled(key)
    try:
        with _budget.analysis_budget(lines=source.count(b"\n")):
            done = _rewrite_checked(source, rule, targets, path, allow_unsafe, options)
    except (UserError, _budget.OverBudget) as exc:
        _remember(key, exc)
        raise
    _remember(key, done)
    return done  # what is kept is a copy of it


# ---- one rewrite per input in a process ------------------------------------------------------------------------
# `apply` dry-runs every finding's fix on the file as profiled (the verdict suggest shows), then rewrites the
# same file: the rule it runs first on that text asks for the very rewrite the dry run made. A rewrite is a
# function of its inputs, so it is made once per process and recalled (a copy) after; a refusal or an
# over-budget analysis is recalled too, so the dry run's verdict and apply's cannot disagree by the clock.
_REWRITES: dict[tuple, tuple[bytes, RuleResult] | Exception] = {}
_REWRITES_KEPT = 64


def forget_rewrites() -> None:
    """Drop the rewrites this process remembers (tests that change a codemod between two calls)."""
    _REWRITES.clear()


def _memo_key(source, rule, targets, path, allow_unsafe, options) -> tuple | None:
    """What a rewrite depends on, as a key; None where an input cannot be keyed (it is then not kept)."""
    try:
        wanted = (
            None
            if targets is None
            else json.dumps(
                [(t.line, t.end_line, _facts_key(t), t.moved_lines, t.finding_rule) for t in targets],
                sort_keys=True,
            )
        )
        extra = json.dumps(options, sort_keys=True) if options else ""
    except (TypeError, ValueError):
        return None
    budget = _budget.budget_seconds(source.count(b"\n"))
    codemod = registry.get_codemod(rule)
    return (sha256(source), rule, codemod, wanted, str(path), allow_unsafe, extra, budget, _relevance.ENABLED)


def _remember(key: tuple | None, done: tuple[bytes, RuleResult] | Exception) -> None:
    if key is None:
        return
    if len(_REWRITES) >= _REWRITES_KEPT:
        _REWRITES.pop(next(iter(_REWRITES)))
    # a copy either way: an exception's copy carries no traceback (which would keep the pass's frames and
    # their libcst trees alive while it is remembered)
    _REWRITES[key] = copy.copy(done) if isinstance(done, Exception) else copy.deepcopy(done)


def _recalled(key: tuple) -> tuple[bytes, RuleResult]:
    done = _REWRITES[key]
    if isinstance(done, Exception):
        raise copy.copy(done)
    return copy.deepcopy(done)


def _rewrite_checked(
    source: bytes,
    rule: str,
    targets: Sequence[Target] | None,
    path: Path | str,
    allow_unsafe: bool,
    options: dict[str, Any] | None,
) -> tuple[bytes, RuleResult]:
    codemod_cls = registry.get_codemod(rule)
    module = _parse(source, path)  # a file that does not parse is refused whatever the rule
    if targets is None and _no_static_pass(codemod_cls, source):
        return source, RuleResult(rule, before=source, after=source)
    new_module, codemod = _run_once(codemod_cls, module, targets, path, allow_unsafe, options, source)
    new_source = _metadata.text(new_module)
    result = _result_of(rule, codemod, source, new_source)
    if new_source == source:
        return source, result
    try:
        _metadata.parse(new_source)  # kept: the stability pass below and the next rule read this text
        compile(new_source, str(path), "exec", dont_inherit=True)
    except (cst.ParserSyntaxError, SyntaxError, ValueError) as exc:
        raise UserError(
            f"{path}: the {rule} rewrite does not parse ({exc.__class__.__name__}: {exc}); nothing written"
        ) from None
    # stability: every match left after the rewrite is one the targets did not ask for
    if targets is None:
        expected_left = 0
    else:
        _, everything = _run_once(codemod_cls, module, None, path, allow_unsafe, options, source)
        # changes only a profile's targets ask for (say, a regional compile) have no static match
        static_kind = len(codemod.changes) - getattr(codemod, "targets_only", 0)
        expected_left = len(everything.changes) - static_kind
    again_module, again = _run_once(
        codemod_cls, _parse(new_source, path), None, path, allow_unsafe, options, new_source
    )
    if len(again.changes) != max(expected_left, 0) or (
        targets is None and _metadata.text(again_module) != new_source
    ):
        raise UserError(
            f"{path}: the {rule} rewrite is not stable (a second pass would change it again); nothing written"
        )
    return new_source, result


# ---- line mapping across rewrites ------------------------------------------------------------------------------
class LineMap:
    """Maps 1-based line ranges of an old text onto a new one (through difflib's opcodes)."""

    def __init__(self, old: bytes, new: bytes) -> None:
        a = old.decode("utf-8", errors="surrogateescape").splitlines()
        b = new.decode("utf-8", errors="surrogateescape").splitlines()
        self.opcodes = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
        self.identity = a == b

    def map(self, start: int, end: int) -> tuple[int, int, bool]:
        """(new start, new end, whether the range touches changed lines)."""
        if self.identity:
            return start, end, False
        touched = False
        new_start = new_end = None
        for tag, i1, i2, j1, j2 in self.opcodes:
            lo, hi = i1 + 1, i2  # old lines of this opcode, 1-based inclusive
            if tag == "insert":
                if start <= i1 < end:  # lines inserted inside the range
                    touched = True
                continue
            if hi < start or lo > end:
                continue
            if tag != "equal":
                touched = True
            if new_start is None:
                new_start = j1 + 1 + (max(start, lo) - lo if tag == "equal" else 0)
            new_end = j1 + (min(end, hi) - lo) + 1 if tag == "equal" else max(j2, j1 + 1)
        if new_start is None:
            return start, end, True
        return new_start, max(new_end or new_start, new_start), touched


@lru_cache(maxsize=8)
def _line_map(old: bytes, new: bytes) -> LineMap:
    """LineMap(old, new), once per pair of texts (the rules of a second round all run on one text)."""
    return LineMap(old, new)


def dry_run(
    path: Path, rule: str, targets: Sequence[Target], source: bytes | None = None
) -> list[str | None]:
    """Per target: None when the codemod rewrites lines inside it, else why not (one line)."""
    try:
        source = path.read_bytes() if source is None else source
        after, result = rewrite_source(source, rule, list(targets), path, allow_unsafe=True)
    except (OSError, UserError) as exc:
        return [f"the {rule} rewrite fails here ({exc})"] * len(targets)
    except _budget.OverBudget as exc:  # not offered: "not checked: source analysis over budget (in ...)"
        return [str(exc)] * len(targets)
    except Exception as exc:  # noqa: BLE001 - a crashing codemod blocks its fixes, it does not end suggest
        return [f"the {rule} rewrite crashed ({type(exc).__name__}: {exc})"] * len(targets)
    line_map = LineMap(source, after)
    if result.already is not None:
        return [f"already applied: {result.already}"] * len(targets)
    if registry.get_codemod(rule).FILE_LEVEL:  # one rewrite serves every target in the file
        if result.changes:
            return [None] * len(targets)
        reason = _sentence(result.skipped[0].message) if result.skipped else None
        return [reason or f"the {rule} rewrite found no code it can rewrite in this file"] * len(targets)
    out: list[str | None] = []
    for target in targets:
        # changed lines inside it, or a change the codemod says it made for it (an autograd.Function's
        # dropout is rewritten at its call site and noted at the finding's lines, where the profile saw it)
        if line_map.map(target.line, target.end_line)[2] or any(
            target.line <= n.line <= target.end_line for n in result.changes
        ):
            out.append(None)
            continue
        reasons = [n.message for n in result.skipped if target.line <= n.line <= target.end_line]
        out.append(
            _sentence(reasons[0]) if reasons else f"the {rule} rewrite found no code it can rewrite here"
        )
    return out


def _sentence(reason: str) -> str:
    for prefix in ("not rewritten: ", "not fused: ", "not applied: "):
        reason = reason.removeprefix(prefix)
    return reason


def _facts_key(target: Target) -> dict[str, Any] | None:
    """The target's facts as plain data (a memo key), with their class: two classes may share fields."""
    if target.facts is None:
        return None
    return {"class": type(target.facts).__qualname__, **target.facts.to_details()}


def _map_target(target: Target, maps: Sequence[tuple[str, LineMap]]) -> tuple[Target, str | None]:
    """The target on the current text, and the rule that already rewrote its lines (if one did).

    The per-step lines a finding's facts carry (`Target.step_lines`: label -> [first, last]) move too.
    """
    start, end, touched_by = target.line, target.end_line, None
    for rule, line_map in maps:
        start, end, touched = line_map.map(start, end)
        if touched and touched_by is None:
            touched_by = rule
    moved = target.moved_lines
    if maps and target.step_lines():
        moved = {}
        for label, span in target.step_lines().items():
            a, b = span[0], span[-1]
            for _, line_map in maps:
                a, b, _ = line_map.map(a, b)
            moved[label] = [a, b]
    return Target(start, end, target.facts, moved_lines=moved), touched_by


def _own_target(f: Any) -> Target:
    """The target of a finding for its rule's own codemod (its facts checked against the codemod's)."""
    target = finding_target(f, registry.get_codemod(f.rule).FACTS)
    return replace(target, finding_rule=f.rule)


# ---- the plan ------------------------------------------------------------------------------------------------------
@dataclass
class FileJob:
    path: Path
    current: bytes
    original: bytes  # what the findings' lines refer to (the profiled file)
    targets: dict[str, list[Target]] | None  # rule -> targets; None: static mode
    rules: list[str] = field(default_factory=list)
    earlier: str = ""  # who made `current` differ from `original` ("an earlier apply (fused_softmax)")
    earlier_rules: tuple[
        str, ...
    ] = ()  # the rules whose rewrites an earlier apply of this run left in `current`
    allow_unsafe: bool = False
    keep_going: bool = False  # `--rule all`: a rule whose rewrite fails is reported and the others go on
    # only which rules would rewrite the file is asked (apply's note on the rules --unsafe would add): the
    # rules' first passes over the original answer it, no second round
    dry: bool = False


def _run_jobs(jobs: Sequence[FileJob], messages: list[str]) -> list[FileResult]:
    root = project_root()
    return [_run_job(job, messages, root) for job in jobs]


def _run_job(job: FileJob, messages: list[str], root: Path) -> FileResult:
    """Run the job's rules one after the other on its file, each on the text the previous one left."""
    text = job.current
    maps: list[tuple[str, LineMap]] = []
    if job.original != job.current:
        maps.append((job.earlier or "an earlier apply", LineMap(job.original, job.current)))
    file_result = FileResult(job.path, job.current, job.current)
    first_round = _first_round(job) if _merges(job) else None
    rules = job.rules
    if first_round is not None:
        text, rules = first_round.text, first_round.again
        file_result.rules.extend(first_round.results)
    merged = {r.rule for r in first_round.results if r.before != r.after} if first_round else set()
    for rule in rules:
        composes = registry.get_codemod(rule).COMPOSES
        if job.targets is not None and rule in job.earlier_rules:
            _say_already_applied(job, rule, messages, root)
            continue
        targets, covered, pairs = _placed_targets(job, rule, maps, composes)
        if targets is not None and not targets:
            _say_covered(job.path, rule, covered, messages, root)
            continue
        rewritten = _rewrite_rule(job, rule, text, targets, messages, root)
        if rewritten is None:
            continue
        new_text, rule_result = rewritten
        _name_findings(rule_result, pairs, text, job.original)
        if targets:
            _unmatched(job.path, rule, pairs, rule_result, LineMap(text, new_text), messages, root)
        _say_covered(job.path, rule, covered, messages, root)
        if rule in merged:
            if new_text == text:
                continue  # its stability check: the first round's result says what it did
            rule_result = replace(rule_result, skipped=[], notes=[])  # the first round's said those
        file_result.rules.append(rule_result)
        if new_text != text:
            maps.append((rule, LineMap(text, new_text)))
            text = new_text
    file_result.after = text
    if file_result.changed:
        changed = [r.rule for r in file_result.rules if r.before != r.after]
        file_result.parity_original = _parity_original(job, changed)
    return file_result


def _say_already_applied(job: FileJob, rule: str, messages: list[str], root: Path) -> None:
    """The same findings, already applied to this file by an earlier apply: one line, not one "already
    rewritten" / "found no code" per finding."""
    n = len(job.targets.get(rule, []))
    messages.append(
        f"{display_path(job.path, root)}: {shown_rule(rule, job.targets.get(rule, []))}: already applied by an earlier apply "
        f"({n} finding{'s' if n != 1 else ''}); nothing more to do"
    )


def _placed_targets(
    job: FileJob, rule: str, maps: Sequence[tuple[str, LineMap]], composes: bool
) -> tuple[list[Target] | None, list[tuple[Target, str]], list[tuple[Target, Target]]]:
    """(the rule's targets on the current text, None in static mode; those an earlier rewrite or edit
    covered, with who; (as profiled, on the current text) pairs)."""
    covered: list[tuple[Target, str]] = []
    pairs: list[tuple[Target, Target]] = []
    if job.targets is None:
        return None, covered, pairs
    targets = []
    for target in job.targets.get(rule, []):
        mapped, touched_by = _map_target(target, maps)
        if touched_by is not None and (not composes or touched_by == EDITED_SINCE_PROFILE):
            covered.append((target, touched_by))
        else:
            targets.append(mapped)
            pairs.append((target, mapped))
    return targets, covered, pairs


def _rewrite_rule(
    job: FileJob, rule: str, text: bytes, targets: list[Target] | None, messages: list[str], root: Path
) -> tuple[bytes, RuleResult] | None:
    """The rule's rewrite of `text`; None (and a message) when it failed and the other rules go on, or
    ran over its analysis budget."""
    try:
        return rewrite_source(text, rule, targets, job.path, job.allow_unsafe)
    except UserError as exc:
        if not job.keep_going or "cannot parse it" in str(exc):
            raise
        messages.append(f"error: {exc} (for {shown_rule(rule, targets or [])}; the other rules go on)")
    except _budget.OverBudget as exc:  # reported like a skipped fix; nothing of it written
        messages.append(f"{display_path(job.path, root)}: {shown_rule(rule, targets or [])}: {exc}")
    return None


# ---- a static `--rule all`: every rule's first pass on the original, put together ----------------------------
@dataclass
class _FirstRound:
    text: bytes  # the original with the merged rules' rewrites (the original itself when none changed it)
    results: list[RuleResult]  # the merged rules' (chained: one's after is the next's before); every rule's
    # when none changed the file, or for a dry job (FileJob.dry: each as it came from the original)
    again: list[str]  # the rules the second round runs on `text`, in order


def _merges(job: FileJob) -> bool:
    """Static mode's first apply of several rules: their first passes can share the original's metadata."""
    static_first = job.targets is None and job.original == job.current
    return static_first and len(job.rules) > 1 and _relevance.ENABLED and _MERGE


def _first_round(job: FileJob) -> _FirstRound | None:
    """Every rule's pass over the original (one parse and metadata for all), the rewrites that touch no
    earlier rule's lines put together as line hunks (_merge.py), their imports added as each rule would.

    Before this, each rule ran on the text the rule before it left: a `--rule all` that changed k rules
    computed libcst's metadata k+1 times. The second round still runs every rule, in order, on the merged
    text: a merged rule must change nothing there (its stability check), and a rule left out (its lines
    touched by an earlier one's) or made possible by another's rewrite runs as before. None where the
    merged text does not compile: every rule then runs one after another from the original."""
    original = job.original
    module = _parse(original, job.path)
    passes: list[tuple[RuleResult, list[_merge.Hunk], list[Any]]] = []
    taken: list[_merge.Hunk] = []
    failed: list[str] = []
    unchanged: list[RuleResult] = []
    every: list[RuleResult] = []
    for rule in job.rules:
        first = _first_pass(original, module, rule, job)
        if first is None:
            failed.append(rule)  # the second round runs it again, and says why
            continue
        result, imports = first
        every.append(result)
        body = _merge.hunks(original, result.after)
        if not body and not imports:
            unchanged.append(result)
        elif not _merge.clashes(body, taken):
            taken.extend(body)
            passes.append((result, body, imports))
    if not passes or job.dry:
        return _FirstRound(original, every, []) if job.dry else _FirstRound(original, unchanged, failed)
    results, made = _chained(job, module, passes)
    if not results:
        return None
    text = results[-1].after
    try:
        _metadata.parse(text)  # kept: the second round reads this text
        compile(text, str(job.path), "exec", dont_inherit=True)
    except (cst.ParserSyntaxError, SyntaxError, ValueError):
        return None
    lines = original.count(b"\n")
    kept = [r for r in unchanged if _untouched(registry.get_codemod(r.rule), module, lines, made)]
    return _FirstRound(text, [*results, *_placed(job, kept, results)], _again(job, kept))


def _untouched(
    codemod_cls: type[RuleCodemod], module: cst.Module, lines: int, made: Sequence[_merge.Hunk]
) -> bool:
    """Whether a rule that changed nothing in the original would change nothing in the merged text: no hunk
    touches a top-level statement its pass reads (a definition naming one of its words, or any statement
    that is not a definition) nor writes one of its words. Its second-round pass is then not run."""
    words = codemod_cls.SOURCE_WORDS
    if not (codemod_cls.STATIC_MODE and codemod_cls.NEEDS_WORDS and words):
        return False
    spans = _relevance.read_spans(module, words, lines)
    if spans is None:
        return False
    for hunk in made:
        if _relevance.names_any("".join(hunk.lines), words):
            return False
        for start, end in spans:
            inside = (
                start < hunk.start < end if hunk.start == hunk.end else hunk.start < end and start < hunk.end
            )
            if inside:
                return False
    return True


def _placed(job: FileJob, kept: Sequence[RuleResult], results: Sequence[RuleResult]) -> list[RuleResult]:
    """The first round's results of the rules whose second pass is not run (_untouched), each on the text
    the merged rules before it in order left, as one rule after another would have run it."""
    order = {rule: i for i, rule in enumerate(job.rules)}
    out = []
    for result in kept:
        earlier = [r for r in results if order[r.rule] < order[result.rule]]
        text = earlier[-1].after if earlier else job.original
        out.append(_ran_from(result, job.original, text, text))
    return out


def _again(job: FileJob, kept: Sequence[RuleResult]) -> list[str]:
    skip = {r.rule for r in kept}
    return [rule for rule in job.rules if rule not in skip]


def _first_pass(
    original: bytes, module: cst.Module, rule: str, job: FileJob
) -> tuple[RuleResult, list[Any]] | None:
    """One rule's static pass over the original, its imports kept apart; None where it failed (a rewrite
    error, the analysis over budget)."""
    codemod_cls = registry.get_codemod(rule)
    if _no_static_pass(codemod_cls, original):
        return RuleResult(rule, before=original, after=original), []
    try:
        with _budget.analysis_budget(lines=original.count(b"\n")):
            new_module, codemod = _run_once(
                codemod_cls, module, None, job.path, job.allow_unsafe, source=original, defer_imports=True
            )
    except (UserError, _budget.OverBudget):
        return None
    result = _result_of(rule, codemod, original, _metadata.text(new_module))
    _name_findings(result, [], original, original)  # each note's line in the file as it was
    return result, codemod.imports_asked


def _chained(
    job: FileJob, module: cst.Module, passes: Sequence[tuple[RuleResult, list[_merge.Hunk], list[Any]]]
) -> tuple[list[RuleResult], list[_merge.Hunk]]:
    """The merged rules' results, each from the text the one before it left (the original with the earlier
    rules' hunks and imports) to that text with its own, their lines moved onto the text each ran from; and
    the hunks that make the last one from the original."""
    original = job.original
    body: list[_merge.Hunk] = []
    with_imports = module
    import_hunks: list[_merge.Hunk] = []
    results: list[RuleResult] = []
    made: list[_merge.Hunk] = []
    before = original
    for result, hunks, imports in passes:
        body.extend(hunks)
        if imports:
            with_imports = base.with_imports(with_imports, imports, str(job.path))
            import_hunks = _merge.hunks(original, with_imports.bytes, _merge.IMPORTS)
        if _merge.clashes(import_hunks, body):
            break  # an import where a rewrite is: the rest runs in the second round
        made = [*import_hunks, *body]
        after = _merge.applied(original, made)
        results.append(_ran_from(result, original, before, after))
        before = after
    return results, made


def _ran_from(result: RuleResult, original: bytes, before: bytes, after: bytes) -> RuleResult:
    """A first-round result (lines on the original) as if its rule had run on `before` and left `after`."""
    line_map = _line_map(original, before)

    def moved(notes: Sequence[Note]) -> list[Note]:
        return [replace(n, line=line_map.map(n.line, n.line)[0]) for n in notes]

    changes, skipped, notes = moved(result.changes), moved(result.skipped), moved(result.notes)
    return replace(result, changes=changes, skipped=skipped, notes=notes, before=before, after=after)


def _parity_original(job: FileJob, changed: Sequence[str]) -> bytes | None:
    """The original with the rewrites of the PARITY_BASELINE twin of each rule that `changed` the file
    applied (say, dropout written by hand -> opadvisor.kernels.dropout), or None when none changes it.

    verify's parity run neutralises the dropout it knows (nn.Dropout, F.dropout, opadvisor.kernels) in both
    programs; a hand-written dropout in the original it cannot reach, so the original it compares with
    carries the same replacement, which the harness then neutralises like the rewrite's. A rule that left
    the file alone left its hand-written dropout in the rewrite too: its twin is not run. The original's
    parse and metadata are still kept from the rules' first passes (_metadata's last few texts)."""
    text = job.original
    for rule in [r for r in job.rules if r in changed]:
        twin = getattr(registry.get_codemod(rule), "PARITY_BASELINE", None)
        if twin is None:
            continue
        targets = None if job.targets is None else job.targets.get(rule, [])
        try:
            with _budget.analysis_budget(lines=text.count(b"\n")):
                new_module, _ = _run_once(
                    twin, _parse(text, job.path), targets, job.path, job.allow_unsafe, source=text
                )
        except _budget.OverBudget:
            continue  # the rule's own rewrite ran the same analysis, past the same budget: nothing to match
        text = _metadata.text(new_module)
    return text if text != job.original else None


def _say_covered(
    path: Path, rule: str, covered: Sequence[tuple[Target, str]], messages: list[str], root: Path
) -> None:
    """One line per rule (and per rewrite that got there first) for findings whose lines another rewrite
    already changed."""
    by_whom: dict[str, list[Target]] = {}
    for target, by in covered:
        by_whom.setdefault(by, []).append(target)
    for by, targets in by_whom.items():
        why = f"those lines were already rewritten by {by}"
        if by == EDITED_SINCE_PROFILE:
            why = "its lines were edited since the profile, so the finding cannot be placed on the file; profile again"
        for target in sorted(set(targets), key=lambda t: t.line):
            messages.append(
                f"{display_path(path, root)}:{span(target.line, target.end_line)}: {target.finding_rule or rule}: "
                f"not applied: {why}"
            )


def _unmatched(
    path: Path,
    rule: str,
    pairs: Sequence[tuple[Target, Target]],
    result: RuleResult,
    line_map: LineMap,
    messages: list[str],
    root: Path,
) -> None:
    """Say which findings the codemod found nothing to do at (so no finding is silently dropped)."""
    shown = shown_rule(rule, [profiled for profiled, _ in pairs])
    if result.already is not None:
        messages.append(f"{display_path(path, root)}: {shown}: already applied: {result.already}")
        return
    if registry.get_codemod(rule).FILE_LEVEL:  # one rewrite serves every target in the file
        if not result.changes and not result.skipped:
            messages.append(
                f"{display_path(path, root)}: {shown}: not applied: the {shown} rewrite found no code it can "
                "rewrite in this file"
            )
        return
    lines = [n.line for n in (*result.changes, *result.skipped)]
    for profiled, target in pairs:
        if line_map.map(target.line, target.end_line)[2]:
            continue  # the rewrite changed those lines
        if not any(target.line <= line <= target.end_line for line in lines):
            shown = profiled.finding_rule or rule
            messages.append(
                f"{display_path(path, root)}:{span(profiled.line, profiled.end_line)}: {shown}: not applied: "
                f"the {shown} rewrite found no code it can rewrite there"
            )


def shown_rule(rule: str, targets: Sequence[Target]) -> str:
    """The rule a message names: the findings' own rule for a library fix's codemod (`library_patch`,
    `hf_attn_implementation`, ...: names `opadvisor rules` does not list, issue 30), else `rule`."""
    if rule not in registry.LIBRARY_CODEMODS:
        return rule
    return ", ".join(dict.fromkeys(t.finding_rule for t in targets if t.finding_rule)) or rule


def span(line: int, end_line: int) -> str:
    """A line range as every command names a finding's (`Finding.lines`): "35-40", or "58"."""
    return f"{line}-{end_line}" if end_line != line else str(line)


def _name_findings(
    result: RuleResult, pairs: Sequence[tuple[Target, Target]], text: bytes, original: bytes
) -> None:
    """Name each of the rule's notes by the finding it belongs to (issue 30): the finding's lines as
    profiled and its rule, never the lines of a text an earlier rewrite moved. A rewrite restricted to
    findings reports at or near their lines (a chain may start a line above the profiled range): the
    nearest finding; with none (static mode), the note's own line in the profiled file."""
    back = _line_map(text, original) if text != original and not pairs else None

    def distance(n: Note, mapped: Target) -> int:
        return max(mapped.line - n.line, n.line - mapped.end_line, 0)

    def named(n: Note) -> Note:
        if pairs:
            profiled, _ = min(pairs, key=lambda pair: distance(n, pair[1]))
            return replace(
                n, where=span(profiled.line, profiled.end_line), finding_rule=profiled.finding_rule
            )
        return replace(n, where=str(back.map(n.line, n.line)[0] if back else n.line))

    result.changes = [named(n) for n in result.changes]
    result.skipped = [named(n) for n in result.skipped]
    result.notes = [named(n) for n in result.notes]


# ---- profile mode ------------------------------------------------------------------------------------------------------
def selected_rules(rule: str, allow_unsafe: bool, messages: list[str]) -> tuple[list[str], list[str]]:
    """(the rules `--rule` names, with their codemods; the unsafe ones `all` holds back without --unsafe).

    Refusals are UserErrors. The held-back rules still run, so that only those that found something are
    named (`say_withheld`)."""
    if rule == "all":
        chosen, withheld = [], []
        for rid in registry.fixable_rules():
            try:
                cls = registry.get_codemod(rid)
            except ImportError as exc:  # a codemod module not written yet
                messages.append(f"{rid}: no codemod available ({exc}); skipped")
                continue
            (withheld if cls.SAFETY == "unsafe" and not allow_unsafe else chosen).append(rid)
        return chosen, withheld
    from opadvisor.rules import registry as rules_registry

    if rule not in rules_registry.rule_ids() and not registry.has_codemod(rule):
        raise UserError(
            f"unknown rule {rule!r}; rules with automatic fixes: {', '.join(registry.fixable_rules())}, or all"
        )
    cls = registry.get_codemod(rule)  # UserError for a rule without a fix
    if cls.SAFETY == "unsafe" and not allow_unsafe:
        raise UserError(
            f"the {rule} fix is marked unsafe (see `opadvisor explain {rule}`); pass --unsafe to apply it"
        )
    return [rule], []


def say_withheld(withheld: Sequence[str], found: set[str], messages: list[str]) -> None:
    """One line per held-back unsafe rule that would have had something to do (silence for the rest)."""
    for rid in withheld:
        if rid in found:
            messages.append(f"{rid}: not applied: its fix is marked unsafe; pass --unsafe to apply it too")


def load_applied(state: Path) -> dict[str, Any]:
    path = state / APPLIED_FILE
    if not path.is_file():
        return {"schema": APPLIED_SCHEMA, "applied": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); move it away to continue") from None
    if (
        not isinstance(data, dict)
        or data.get("schema") != APPLIED_SCHEMA
        or not isinstance(data.get("applied"), list)
    ):
        raise UserError(f"{path} is not an applied.json this opadvisor reads (schema {APPLIED_SCHEMA})")
    return data


def _entries_for(applied: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    return [e for e in applied["applied"] if isinstance(e, dict) and e.get("path") == str(path)]


def apply_findings(
    findings: Sequence[Any],
    rules: Sequence[str],
    run_dir: Path,
    sources: dict[str, str],
    *,
    allow_unsafe: bool = False,
    force: bool = False,
    write: bool = True,
    messages: list[str] | None = None,
    explicit_rule: str | None = None,
) -> ApplyResult:
    """Apply the codemods of `rules` at the given findings (`opadvisor.rules.finding.Finding`s)."""
    messages = messages if messages is not None else []
    root = project_root()
    applied = load_applied(run_dir)
    if explicit_rule is not None and not any(f.rule == explicit_rule for f in findings):
        messages.append(
            f"{explicit_rule}: no findings in this run, so nothing to fix (`opadvisor suggest` lists what it found)"
        )
    applicable = _applicable(findings, rules, root, messages, allow_unsafe, explicit_rule)
    if explicit_rule is None:
        applicable = _resolve_alternatives(applicable, messages, root, run_dir, sources)
    by_path = _targets_by_path(applicable, root, messages)
    jobs: list[FileJob] = []
    for path, targets in by_path.items():
        job = _profile_job(path, targets, run_dir, applied, sources, root, messages, allow_unsafe, force)
        if job is not None:
            job.keep_going = explicit_rule is None
            jobs.append(job)
    result = ApplyResult(_run_jobs(jobs, messages), messages, run_dir)
    if write and result.changed:
        _write(result, run_dir, applied)
        result.written = True
    return result


def _applicable(
    findings: Sequence[Any],
    rules: Sequence[str],
    root: Path,
    messages: list[str],
    allow_unsafe: bool,
    explicit_rule: str | None,
) -> list[Any]:
    """The findings of `rules` whose fix may be applied; a line in `messages` for each one left out. An
    explicit rule whose fixes are all unsafe (without --unsafe) is a UserError."""
    applicable = []
    withheld = []
    for f in findings:
        if f.rule not in rules:
            continue
        if getattr(f, "fix_blocked", None):
            messages.append(f"{_where(f, root)}: {f.rule}: not applied: {f.verdict()}")
            continue
        if f.fix == "none" and not (f.rule == explicit_rule and getattr(f, "on_request", False)):
            advice = f" ({f.advice})" if getattr(f, "advice", "") else ""
            messages.append(f"{_where(f, root)}: {f.rule}: note: no automatic fix for this one{advice}")
            continue
        if f.fix == "unsafe" and not allow_unsafe:
            withheld.append(f)
            messages.append(f"{_where(f, root)}: {f.rule}: not applied: its fix is unsafe; pass --unsafe")
            continue
        applicable.append(f)
    if explicit_rule is not None and withheld and not applicable:
        f = withheld[0]
        more = f" (and {len(withheld) - 1} more)" if len(withheld) > 1 else ""
        raise UserError(
            f"the {f.rule} fix at {_where(f, root)}{more} is unsafe "
            f"(see `opadvisor explain {f.rule}`); pass --unsafe to apply it"
        )
    return applicable


def _targets_by_path(
    applicable: Sequence[Any], root: Path, messages: list[str]
) -> dict[Path, dict[str, list[Target]]]:
    """file -> codemod -> targets, for the findings to apply (a library finding's fix goes into the user's
    script); files outside the project are refused (a UserError when no file is left)."""
    by_path: dict[Path, dict[str, list[Target]]] = {}
    refused: list[str] = []
    for f in applicable:
        routed = library_target(f)
        if routed is None and getattr(f, "library", None) is not None:
            messages.append(f"{_where(f, root)}: {f.rule}: not applied: {f.advice}")
            continue
        key, where, target = routed or (f.rule, f.path, _own_target(f))
        path = Path(where).resolve()
        problem = location_problem(path, root)
        if problem is not None:
            refused.append(problem)
            continue
        by_path.setdefault(path, {}).setdefault(key, []).append(target)
    if refused and not by_path:
        raise UserError(refused[0] + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""))
    for problem in dict.fromkeys(refused):
        messages.append(f"not applied: {problem}")
    return by_path


def _profile_job(
    path: Path,
    targets: dict[str, list[Target]],
    run_dir: Path,
    applied: dict[str, Any],
    sources: dict[str, str],
    root: Path,
    messages: list[str],
    allow_unsafe: bool,
    force: bool,
) -> FileJob | None:
    """The job for one file of a profile-mode apply: the findings' lines are placed on the file as
    profiled (an earlier apply's result maps back to its backup; with --force an edited file maps through
    the copy the run keeps). None (and a message) when they cannot be placed; a UserError when the file
    changed since the profile and --force was not given."""
    current = _read(path)
    original = current
    entries = _entries_for(applied, path)
    recorded = sources.get(str(path))
    if recorded is None:
        recorded = next((h for p, h in sources.items() if Path(p).resolve() == path), None)
    now = sha256(current)
    earlier_label = None
    if entries and entries[-1].get("sha256_after") == now:
        backup = run_dir / entries[0]["backup"]
        if backup.is_file():
            original = backup.read_bytes()
    elif force and recorded is not None and recorded != now:
        # issue 30: place the findings' lines on the edited file through a diff against the source as
        # profiled (kept in the run); a finding whose own lines were edited is refused, never guessed
        profiled = profiled_source(run_dir, recorded)
        if profiled is None:
            messages.append(
                f"not applied: {_rel(str(path), root)} changed since it was profiled and the run keeps no "
                "copy of it as profiled, so the findings' lines cannot be placed on it; profile again"
            )
            return None
        original, earlier_label = profiled, EDITED_SINCE_PROFILE
    elif not force:
        _check_profiled_hash(path, recorded, now)
    _check_writable(path)
    ordered = codemod_order(targets)
    earlier_rules = tuple(dict.fromkeys(str(e.get("rule")) for e in entries))
    earlier = ", ".join(earlier_rules)
    if original == current:
        earlier_rules = ()  # the file is not the earlier apply's result (restored, or another file)
    return FileJob(
        path,
        current,
        original,
        targets,
        ordered,
        earlier_label or f"an earlier apply ({earlier})",
        earlier_rules,
        allow_unsafe,
    )


def _check_profiled_hash(path: Path, recorded: str | None, now: str) -> None:
    """Refuse a file whose lines cannot be trusted: no hash recorded, or changed since the profile."""
    if recorded is None:
        raise UserError(
            f"{path}: the profile recorded no hash for it, so its lines cannot be trusted; "
            "re-profile, or pass --force"
        )
    if recorded != now:
        raise UserError(
            f"{path} changed since it was profiled (sha256 differs), so the findings' lines may have "
            "moved; re-profile, or pass --force to apply anyway"
        )


def library_target(f: Any) -> tuple[str, str, Target] | None:
    """For a finding in library code: (codemod, user file, target) of its fix, which goes into the user's
    script (after the model's construction, or at the call into the library); None when it has none."""
    library = getattr(f, "library", None)
    if not isinstance(library, dict):
        return None
    fix = library.get("fix") or {}
    if fix.get("kind") == "patch":
        key, site = "library_patch", library.get("model")
    elif fix.get("kind") == "switch":
        key = fix.get("name")
        site = library.get("called_from") if key == "mha_need_weights" else library.get("model")
    elif fix.get("kind") == "rule":  # the rule's own codemod, in the script that calls into the library
        key, site = f.rule, library.get("called_from")
    else:
        return None
    known = key in registry.LIBRARY_CODEMODS or (fix.get("kind") == "rule" and registry.has_codemod(key))
    if not known or not site or not site.get("path") or not site.get("line"):
        return None
    rules = [fix.get("select") or f.rule]  # an opt-in patch (compile_blocks) is asked for by its name
    if fix.get("kind") == "rule":  # the rule's own fix, which reads the finding's facts
        facts = _own_target(f).facts
    else:
        facts = LibraryFixFacts(rules, fix.get("safety") == "unsafe", fix.get("name"))
    return key, site["path"], Target(site["line"], site["line"], facts, f.rule)


def _resolve_alternatives(
    findings: list[Any], messages: list[str], root: Path, run_dir: Path, sources: dict[str, str]
) -> list[Any]:
    """Of two findings whose fixes rewrite the same lines another way (`Finding.alternative`), keep
    the bigger win when a dry run shows its codemod can rewrite the site, else the other one."""
    dropped: set[int] = set()
    for f in findings:
        alternative = getattr(f, "alternative", None)
        if id(f) in dropped or alternative is None or not alternative.bigger_win:
            continue
        other = next((g for g in findings if alternative.names(g) and g.path == f.path), None)
        if other is None or id(other) in dropped:
            continue
        path = Path(f.path).resolve()
        library = getattr(f, "library", None) is not None  # fixed in the user's script, not at f.path
        reason = f.fix_blocked  # the dry run's verdict, made once (check_fixes) where the file is as profiled
        if reason is None and path.is_file() and not library and f.source_status != "ok":
            # the file changed since (apply --force): judged on the source as profiled, where its lines are
            kept = profiled_source(run_dir, sources.get(f.path))
            reason = dry_run(path, f.rule, [finding_target(f, registry.get_codemod(f.rule).FACTS)], kept)[0]
        if reason is None:
            dropped.add(id(other))
            messages.append(
                f"{_where(other, root)}: {other.rule}: not applied: {f.rule} ({f.lines()}) rewrites the "
                "same lines and is the bigger win"
            )
        else:
            dropped.add(id(f))
            messages.append(
                f"{_where(f, root)}: {f.rule}: not applied: no automatic fix here: {reason}; {other.rule} "
                f"({other.lines()}), which rewrites the same lines, is applied instead"
            )
    return [f for f in findings if id(f) not in dropped]


def _rel(path: str, root: Path) -> str:
    return display_path(Path(path), root)


def _where(f: Any, root: Path) -> str:
    """A finding as every command names it: file:lines as profiled (a library file by its path within
    site-packages, as suggest shows it)."""
    library = getattr(f, "library", None)
    path = library["file"] if isinstance(library, dict) and library.get("file") else _rel(f.path, root)
    return f"{path}:{f.lines()}"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist (it was moved or deleted since the profile?)") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None


# ---- static mode ---------------------------------------------------------------------------------------------------------
def static_state_dir() -> Path:
    from opadvisor.profile.runs import state_dir

    return state_dir() / STATIC_DIR


def apply_files(
    rule: str,
    files: Sequence[str | Path],
    *,
    allow_unsafe: bool = False,
    write: bool = True,
) -> ApplyResult:
    """Static mode: rewrite every match of `rule` (or "all") in the named files, without a profile."""
    messages: list[str] = []
    rules, withheld = selected_rules(rule, allow_unsafe, messages)
    root = project_root()
    jobs = []
    seen: set[Path] = set()
    for name in files:
        path = Path(name).resolve()
        if path in seen:
            continue
        seen.add(path)
        if not path.exists():
            raise UserError(f"{name}: no such file")
        problem = location_problem(path, root)
        if problem is not None:
            raise UserError(problem)
        _check_writable(path)
        current = _read(path)
        jobs.append(
            FileJob(
                path, current, current, None, list(rules), allow_unsafe=allow_unsafe, keep_going=rule == "all"
            )
        )
    if withheld:  # a dry run: which held-back rules would have rewritten something
        dry = [
            FileJob(j.path, j.current, j.current, None, list(withheld), allow_unsafe=True, dry=True)
            for j in jobs
        ]
        say_withheld(withheld, {r.rule for f in _run_jobs(dry, []) for r in f.rules if r.changes}, messages)
    state = static_state_dir()
    result = ApplyResult(_run_jobs(jobs, messages), messages, state)
    if write and result.changed:
        _write(result, state, load_applied(state))
        result.written = True
    return result


# ---- writing ----------------------------------------------------------------------------------------------------------
def _backup_rel(path: Path) -> Path:
    root = project_root()
    try:
        return Path(BACKUP_DIR) / path.relative_to(root)
    except ValueError:  # outside the project (not reachable through apply's checks)
        return Path(BACKUP_DIR) / "_abs" / path.relative_to(path.anchor)


def _snapshot_rel(index: int, backup_rel: Path) -> Path:
    """Where the file as one entry left it is kept: snapshots/<entry index>/<the backup's path>."""
    parts = backup_rel.parts[1:] if backup_rel.parts[:1] == (BACKUP_DIR,) else backup_rel.parts
    return Path(SNAPSHOT_DIR, str(index), *parts)


def _write(result: ApplyResult, state: Path, applied: dict[str, Any]) -> None:
    changed = result.changed
    new_entries = []
    snapshots: list[tuple[Path, bytes, Path]] = []  # (where, content, the file whose mode it takes)
    for f in changed:
        entries = _entries_for(applied, f.path)
        keep_first = bool(entries) and (state / entries[0]["backup"]).is_file()
        rel = Path(entries[0]["backup"]) if keep_first else _backup_rel(f.path)
        if not keep_first:
            backup = state / rel
            backup.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(backup, f.before, mode_from=f.path)
        parity: dict[str, str] = {}
        if f.parity_original is not None:
            parity_rel = Path(PARITY_DIR) / rel.relative_to(BACKUP_DIR)
            (state / parity_rel).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(state / parity_rel, f.parity_original)
            parity["parity_original"] = parity_rel.as_posix()
        for (
            r
        ) in f.rules:  # one entry per rule that changed the file, chained: one's after is the next's before
            if r.before == r.after:
                continue
            # the file as this rule left it: verify times the program one rule at a time from these
            snapshot = _snapshot_rel(len(applied["applied"]) + len(new_entries), rel)
            snapshots.append((state / snapshot, r.after, f.path))
            new_entries.append(
                {
                    "rule": r.rule,
                    "path": str(f.path),
                    "backup": rel.as_posix(),
                    "sha256_before": sha256(r.before),
                    "sha256_after": sha256(r.after),
                    "after": snapshot.as_posix(),
                    "changes": [{"line": n.line, "message": n.message} for n in r.changes],
                    **parity,
                }
            )
    done: list[FileResult] = []
    try:
        for where, content, mode_from in snapshots:
            where.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(where, content, mode_from=mode_from)
        for f in changed:
            atomic_write(f.path, f.after)
            done.append(f)
        applied = {"schema": APPLIED_SCHEMA, "applied": [*applied["applied"], *new_entries]}
        state.mkdir(parents=True, exist_ok=True)
        atomic_write(state / APPLIED_FILE, (json.dumps(applied, indent=1) + "\n").encode())
    except OSError as exc:
        for f in done:  # put back what was written: all or nothing
            try:
                atomic_write(f.path, f.before)
            except OSError:
                pass
        for where, _, _ in snapshots:
            where.unlink(missing_ok=True)
        raise UserError(f"writing failed ({exc}); every file was restored, nothing changed") from None


# ---- undo --------------------------------------------------------------------------------------------------------------
@dataclass
class Restored:
    path: Path
    rules: list[str]


def undo_state(run: str | None, static: bool) -> Path:
    """Which applied.json `--undo` works on: RUN's, the static one, or the most recently written of the
    latest run's and the static one's."""
    from opadvisor.profile.runs import resolve_run

    if static:
        return static_state_dir()
    if run is not None:
        return resolve_run(run)
    candidates = []
    try:
        candidates.append(resolve_run(None))
    except UserError:
        pass
    candidates.append(static_state_dir())
    with_entries = [c for c in candidates if (c / APPLIED_FILE).is_file() and load_applied(c)["applied"]]
    if not with_entries:
        raise UserError("nothing to undo: no apply is recorded in the latest run or in .opadvisor/static")
    return max(with_entries, key=lambda c: (c / APPLIED_FILE).stat().st_mtime)


def undo(state: Path, files: Sequence[str | Path] | None = None, *, force: bool = False) -> list[Restored]:
    """Restore the files recorded in `state`/applied.json (or only `files`) to their backups."""
    applied = load_applied(state)
    wanted = {Path(f).resolve() for f in files} if files else None
    by_path: dict[str, list[dict[str, Any]]] = {}
    for entry in applied["applied"]:
        if not isinstance(entry, dict) or "path" not in entry:
            continue
        if wanted is not None and Path(entry["path"]) not in wanted:
            continue
        by_path.setdefault(entry["path"], []).append(entry)
    if not by_path:
        where = f" for {', '.join(str(f) for f in files)}" if files else ""
        raise UserError(f"nothing to undo{where}: {state / APPLIED_FILE} records no apply")
    plans = []
    for name, entries in by_path.items():
        path = Path(name)
        backup = state / entries[0]["backup"]
        if not backup.is_file():
            raise UserError(f"the backup of {path} ({backup}) is missing; cannot undo")
        if path.exists() and not force and sha256(path.read_bytes()) != entries[-1].get("sha256_after"):
            raise UserError(
                f"{path} was edited after apply rewrote it; --undo would lose those edits (pass --force)"
            )
        if path.exists():
            _check_writable(path)
        plans.append((path, backup, entries))
    restored = []
    for path, backup, entries in plans:
        atomic_write(path, backup.read_bytes(), mode_from=path if path.exists() else backup)
        restored.append(Restored(path, list(dict.fromkeys(str(e.get("rule", "")) for e in entries))))
    undone = {str(p) for p, _, _ in plans}
    remaining = [e for e in applied["applied"] if not (isinstance(e, dict) and e.get("path") in undone)]
    atomic_write(
        state / APPLIED_FILE,
        (json.dumps({"schema": APPLIED_SCHEMA, "applied": remaining}, indent=1) + "\n").encode(),
    )
    for _, backup, entries in plans:
        if not any(e.get("backup") == backup.relative_to(state).as_posix() for e in remaining):
            backup.unlink(missing_ok=True)
        for e in entries:
            if isinstance(e.get("after"), str):
                (state / e["after"]).unlink(missing_ok=True)
    return restored

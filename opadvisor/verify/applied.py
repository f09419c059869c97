"""What `opadvisor apply` changed in a run: applied.json, read back into the original program's sources.

`apply` writes `applied.json` in the run folder:

    {"schema": 1, "applied": [{"rule": str, "path": absolute path of the rewritten file,
      "backup": path of the byte-exact pre-rewrite copy, relative to the run folder (under backup/),
      "sha256_before": str, "sha256_after": str, "after": the file as this entry left it (snapshots/,
      absent in runs applied by an older opadvisor), "changes": [{"line": int, "message": str}]}]}

with one entry per file per rule per apply, in the order they were made. The original program is the
current tree with each rewritten file replaced by its earliest backup (the copy taken before the first
rewrite). An entry may add "parity_original" (relative to the run folder): the original with the rewrites
that swap one random stream for another (hand-written dropout -> opadvisor.kernels.dropout), which
verify's parity phase runs instead of the backup, since it can neutralise only the dropout it knows. The
program with only the first k applied rules (`Applied.program`) replaces each file by the snapshot of its
last entry among those rules: verify times these to say what each rule saved.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.files import file_sha256

APPLIED_FILE = "applied.json"
APPLIED_SCHEMA = 1
NOTHING_APPLIED = "nothing applied in this run: run opadvisor apply first"


@dataclass
class Change:
    rule: str
    line: int  # 1-based, in the file as it was before that apply
    message: str


@dataclass
class Step:
    """One entry of a file: a rule's rewrite, and the file as it left it (None: no usable snapshot)."""

    rule: str
    after: Path | None


@dataclass
class AppliedFile:
    """One rewritten file: where its original is and what was done to it."""

    path: Path  # absolute path of the rewritten file (what is on disk now)
    original: Path  # absolute path of its earliest backup
    rules: list[str] = field(default_factory=list)  # in the order they were applied
    changes: list[Change] = field(default_factory=list)
    edited_since: bool = False  # the file on disk is not what the last apply wrote
    parity_original: Path | None = None  # the original for the parity phase, when apply wrote one
    steps: list[Step] = field(default_factory=list)  # its entries, in order


@dataclass
class Applied:
    files: list[AppliedFile]

    @property
    def rules(self) -> list[str]:
        """Every rule applied, in the order first applied."""
        seen: dict[str, None] = {}
        for f in self.files:
            for r in f.rules:
                seen.setdefault(r, None)
        return list(seen)

    def names_added(self, rule: str) -> set[str]:
        """The identifiers `rule`'s rewrites added to its files (more of them after than before), and the
        opadvisor.kernels names they newly reference (a class put in place of one of the same name, as
        `torch.optim.AdamW` -> `opadvisor.kernels.AdamW`, adds no identifier): which of its codemod's
        kernel ops a rule with one op per form called. A rewrite without a usable snapshot is read as its
        file's whole change (the backup against the file now)."""
        added: set[str] = set()
        for f in self.files:
            texts = [f.original, *(s.after for s in f.steps)]
            for i, step in enumerate(f.steps):
                if step.rule != rule:
                    continue
                before, after = texts[i], texts[i + 1]
                if before is None or after is None:
                    before, after = f.original, f.path
                old, new = _text(before), _text(after)
                added |= set(_identifiers(new) - _identifiers(old))
                added |= _kernel_names(new) - _kernel_names(old)
        return added

    def sources(self) -> dict[str, str]:
        """{rewritten file: its original (backup)}, as the harness config wants it."""
        return {str(f.path): str(f.original) for f in self.files}

    def parity_sources(self) -> dict[str, str]:
        """`sources()` for the parity phase: a file's parity original where apply wrote one."""
        return {str(f.path): str(f.parity_original or f.original) for f in self.files}

    def program(self, rules: Collection[str]) -> dict[str, str]:
        """The harness `sources` of the program with only `rules` applied: each file as its last entry
        whose rule is in `rules` (and every entry before it too) left it; its backup when none; the file on
        disk when all of its entries are in. Raises ValueError, saying why, when a snapshot is missing."""
        chosen = set(rules)
        out: dict[str, str] = {}
        for f in self.files:
            done = 0
            while done < len(f.steps) and f.steps[done].rule in chosen:
                done += 1
            if done == len(f.steps):
                continue  # every rewrite of this file is in: the file as it is now
            if done == 0:
                out[str(f.path)] = str(f.original)
                continue
            snapshot = f.steps[done - 1].after
            if snapshot is None:
                raise ValueError(
                    f"{f.path.name} has no snapshot of its {f.steps[done - 1].rule} rewrite (applied by an "
                    "older opadvisor, or the snapshot changed): undo and apply again to time each rule"
                )
            out[str(f.path)] = str(snapshot)
        return out

    def rule_order(self) -> tuple[list[str], str | None]:
        """An order to add the rules one at a time so that each step's program exists: every file's
        entries in their own order (ties: the order first applied). ([], why) when there is none."""
        after: dict[str, set[str]] = {r: set() for r in self.rules}  # rule -> rules that must come first
        for f in self.files:
            runs = [s.rule for i, s in enumerate(f.steps) if i == 0 or f.steps[i - 1].rule != s.rule]
            if len(runs) != len(set(runs)):  # a rule applied to the file again after another one
                return [], f"{f.path.name} had {', '.join(runs)} applied in that order"
            for a, b in zip(runs, runs[1:], strict=False):
                after[b].add(a)
        order: list[str] = []
        while len(order) < len(self.rules):
            ready = [r for r in self.rules if r not in order and after[r] <= set(order)]
            if not ready:
                return [], "the rules were applied to the files in different orders"
            order.append(ready[0])
        for k in range(1, len(order)):
            try:
                self.program(order[:k])
            except ValueError as exc:
                return [], str(exc)
        return order, None


_KERNEL_REFERENCE = re.compile(r"opadvisor\.kernels\.(\w+)")
_KERNEL_IMPORT = re.compile(r"from\s+opadvisor\.kernels\s+import\s+\(?([\w\s,]+)")


def _kernel_names(text: str) -> set[str]:
    """The opadvisor.kernels names a file references: `opadvisor.kernels.X` and `from opadvisor.kernels
    import X, Y` (as written by the rewrites; `as` aliases are read as the name imported)."""
    names = set(_KERNEL_REFERENCE.findall(text))
    for group in _KERNEL_IMPORT.findall(text):
        names |= {part.split()[0] for part in group.split(",") if part.split()}
    return names


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _identifiers(text: str) -> Counter[str]:
    return Counter(re.findall(r"[A-Za-z_]\w*", text))


def _snapshot(run_dir: Path, entry: dict[str, Any]) -> Path | None:
    """The entry's `after` snapshot when it is there and still what apply wrote, else None."""
    rel = entry.get("after")
    if not isinstance(rel, str):
        return None
    path = (run_dir / rel).resolve()
    if not path.is_file() or file_sha256(path) != entry["sha256_after"]:
        return None
    return path


def _entry(raw: Any, index: int) -> dict[str, Any]:
    needed = {"rule": str, "path": str, "backup": str, "sha256_before": str, "sha256_after": str}
    if not isinstance(raw, dict) or any(not isinstance(raw.get(k), t) for k, t in needed.items()):
        raise UserError(f"{APPLIED_FILE} is malformed: entry {index} lacks one of {', '.join(needed)}")
    return raw


def load_applied(run_dir: Path) -> Applied:
    """Read applied.json and check its backups; UserError (one line) when it cannot be used."""
    path = run_dir / APPLIED_FILE
    if not path.is_file():
        raise UserError(NOTHING_APPLIED)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != APPLIED_SCHEMA:
        raise UserError(f"{path} has an unknown schema; this opadvisor reads version {APPLIED_SCHEMA}")
    entries = [_entry(raw, i) for i, raw in enumerate(data.get("applied") or [])]
    if not entries:
        raise UserError(NOTHING_APPLIED)

    files: dict[Path, AppliedFile] = {}
    last_hash: dict[Path, str] = {}
    for e in entries:
        target = Path(e["path"]).resolve()
        if target not in files:  # the earliest backup is the original
            backup = (run_dir / e["backup"]).resolve()
            if not backup.is_file():
                raise UserError(f"the backup of {target} ({backup}) is missing; cannot rebuild the original")
            if file_sha256(backup) != e["sha256_before"]:
                raise UserError(f"the backup {backup} does not match the hash apply recorded; it was changed")
            files[target] = AppliedFile(path=target, original=backup)
        f = files[target]
        if e["rule"] not in f.rules:
            f.rules.append(e["rule"])
        parity = e.get("parity_original")
        if isinstance(parity, str) and (run_dir / parity).is_file():
            f.parity_original = (run_dir / parity).resolve()
        f.steps.append(Step(e["rule"], _snapshot(run_dir, e)))
        for c in e.get("changes") or []:
            if isinstance(c, dict) and isinstance(c.get("line"), int):
                f.changes.append(Change(e["rule"], c["line"], str(c.get("message", ""))))
        last_hash[target] = e["sha256_after"]
    for target, f in files.items():
        if not target.is_file():
            raise UserError(f"{target} was rewritten by apply but no longer exists")
        f.edited_since = file_sha256(target) != last_hash[target]
    return Applied(files=list(files.values()))

"""`opadvisor apply`: rewrite the source at the findings of a rule, with a diff, a backup and an undo."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from opadvisor.cli.common import EXIT_FINDINGS, user_errors
from opadvisor.errors import UserError


def register(app: typer.Typer) -> None:
    """Add this module's commands to the app."""
    app.command("apply")(apply)


def _err(line: str) -> None:
    print(line, file=sys.stderr)


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """(run, files) from the positional arguments: .py files (static mode) or one run folder/id."""
    files = [a for a in args if Path(a).is_file() or a.endswith(".py")]
    others = [a for a in args if a not in files]
    if files and others:
        raise UserError(f"give either one RUN or source files, not both ({others[0]!r} is not a file)")
    if len(others) > 1:
        raise UserError(f"give one RUN at most (got {', '.join(others)})")
    for name in files:
        if not Path(name).is_file():
            raise UserError(f"{name}: no such file")
    return (others[0] if others else None), files


@user_errors
def apply(
    targets: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[RUN | FILE...]",
            help="A run folder or id (default: the latest run), or source files to rewrite without a profile.",
            show_default=False,
        ),
    ] = None,
    rule: Annotated[
        str | None,
        typer.Option("--rule", help="The rule whose fixes to apply (see `opadvisor rules`), or `all`."),
    ] = None,
    diff: Annotated[bool, typer.Option("--diff", help="Print the unified diff and write nothing.")] = False,
    check: Annotated[
        bool,
        typer.Option("--check", help="Write nothing; exit 1 if the rewrite would change a file (for CI)."),
    ] = False,
    unsafe: Annotated[
        bool, typer.Option("--unsafe", help="Also apply fixes that change numerics (e.g. fp32_gemm).")
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Rewrite files that changed since the profile (their lines may have moved); with --undo, "
            "restore files edited since the apply.",
        ),
    ] = False,
    undo: Annotated[
        bool,
        typer.Option(
            "--undo",
            help="Restore the files the last apply rewrote (of RUN, or of the named files) from their backups.",
        ),
    ] = False,
) -> None:
    """Rewrite the source where a rule found something, print the diff, and keep a backup.

    Profile mode (the default) takes the findings of --rule in RUN (default: the latest run) and rewrites
    exactly those lines. A file is refused if it changed since the profile (--force overrides), lies
    outside the current directory, or is inside site-packages. Static mode (source files given) rewrites
    every match of the rule in those files, no profile needed.

    Every rewrite is checked (the result parses, a second pass changes nothing) and written atomically,
    after a byte-exact backup: in the run folder (backup/ and applied.json, which `opadvisor verify`
    reads), or for static mode in .opadvisor/static/. `opadvisor apply --undo` puts the files back.

    Examples:

    \b
      opadvisor apply --rule fused_softmax --diff
      opadvisor apply --rule all
      opadvisor apply --rule gemm_align model.py
      opadvisor apply --undo
    """
    _apply(list(targets or []), rule, diff=diff, check=check, unsafe=unsafe, force=force, undo=undo)


def _apply(
    targets: list[str], rule: str | None, *, diff: bool, check: bool, unsafe: bool, force: bool, undo: bool
) -> None:
    from opadvisor.rewrite import engine

    run, files = _split(targets)
    if undo:
        if rule is not None or diff or check:
            raise UserError("--undo takes no --rule, --diff or --check")
        state = engine.undo_state(run, static=bool(files))
        restored = engine.undo(state, files or None, force=force)
        for r in restored:
            _err(f"restored {engine.display_path(r.path)} (undid {', '.join(r.rules)})")
        return
    if rule is None:
        raise UserError("missing --rule: name a rule (see `opadvisor rules`) or `all`")
    write = not (diff or check)
    if files:
        result = engine.apply_files(rule, files, allow_unsafe=unsafe, write=write)
    else:
        from opadvisor.rewrite.check import apply_run

        result = apply_run(rule, run, allow_unsafe=unsafe, force=force, write=write)
    _report(result, engine, show_diff=not check)
    if check and result.changed:
        raise typer.Exit(EXIT_FINDINGS)


def _report(result, engine, *, show_diff: bool) -> None:  # noqa: ANN001 - engine is a module
    if show_diff:
        for f in result.changed:
            sys.stdout.write(f.diff())
    for f in result.files:
        name = engine.display_path(f.path)
        for r in f.rules:  # each note named as its finding is everywhere (issue 30)
            for kind, notes in (("", r.changes), ("not applied: ", r.skipped), ("note: ", r.notes)):
                for n in notes:
                    _err(f"{name}:{n.where or n.line}: {n.finding_rule or r.rule}: {kind}{n.message}")
    for message in result.messages:
        _err(message)
    count = len(result.changed)
    files = f"{count} file{'s' if count != 1 else ''}"
    if not count:
        _err("nothing to rewrite")
    elif result.written:
        where = engine.display_path(result.state_dir) if result.state_dir else "the run folder"
        _err(f"rewrote {files}; backups in {where}/backup (undo: opadvisor apply --undo)")
    else:
        _err(f"would rewrite {files} (nothing written)")

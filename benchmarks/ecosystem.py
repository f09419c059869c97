"""Every codemod in static mode over real model code nobody here wrote (issue 29's ecosystem check).

    python3 benchmarks/ecosystem.py                          # every file of every installed zoo
    python3 benchmarks/ecosystem.py --jobs 16 --out eco.json # the whole set on the 16-core GPU host
    python3 benchmarks/ecosystem.py --sample 40 --jobs 2     # a deterministic sample
    python3 benchmarks/ecosystem.py --match llama --match convnext

The zoos are read from the installed packages (never copied into the repository): every
`transformers/models/*/modeling_*.py`, every public model file of timm (`timm/models/*.py`, not its private
`_builder.py` & co.) and every module of vit-pytorch (plain PyTorch + einops). A zoo that is not installed is
skipped and the summary says so. Nothing is imported from the zoos: their files are found with
`importlib.util.find_spec`, so a broken import (timm's torchvision on a CPU torch) does not matter.

Each file is copied into a temp folder of its own, as if it were the user's, and checked in a process of its
own (forked from this one, which has imported the apply engine already, so the time is the engine's and not
Python's start-up) exactly as `opadvisor apply --rule all --unsafe FILE` runs it
(`engine.apply_files("all", [FILE], allow_unsafe=True)`, writing the file and its backup):

- the time of that apply, its exit status as the CLI would give it (0; 2 for a UserError: the one line the
  CLI prints; 1 for any other exception: a crash, with its traceback), and the rules that failed inside it
  while `--rule all` went on (`error: ... (for RULE; the other rules go on)`);
- a hang: the file's process still running after --timeout seconds; its Python stack is dumped
  (faulthandler, SIGUSR1) before it is killed, so the report says where it was;
- whether the rewritten file compiles (`compile(src, path, "exec")`);
- whether a second apply over the rewritten file changes nothing (with the rules that still changed it).

It prints a summary (files, hangs, crashes, user errors, non-compiling rewrites, unstable second applies,
p50/p95/max seconds of the first apply, the slowest files) and, with --out, writes every file's record.
It exits 1 when any file hung, crashed, failed to compile or was unstable, else 0.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import hashlib
import importlib.util
import json
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

BAD = ("hang", "crash", "noncompiling", "unstable")  # the statuses that fail the check


@dataclass(frozen=True)
class ModelFile:
    zoo: str  # the package it came from
    rel: str  # its path inside the package (the name the report uses)
    path: Path  # where it is installed

    @property
    def key(self) -> str:
        return f"{self.zoo}/{self.rel}"


@dataclass
class Outcome:
    """What happened to one file."""

    file: str  # zoo/path inside the package
    status: str = "ok"  # ok | unchanged | usererror | crash | hang | noncompiling | unstable
    exit_status: int | None = None  # as `opadvisor apply` would exit (None: it hung)
    seconds: float | None = (
        None  # the first apply, in-process: CPU seconds (a loaded machine inflates wall time)
    )
    wall_seconds: float | None = None
    second_seconds: float | None = None
    changed_by: list[str] = field(default_factory=list)  # the rules that rewrote something
    rule_errors: list[str] = field(default_factory=list)  # rules that failed while the others went on
    # rules that gave up on part of the file: "not checked: source analysis over budget (in `f`)"
    over_budget: list[str] = field(default_factory=list)
    detail: str = ""  # the traceback, the user error, the compile error, the unstable rules, the hang's stack
    lines: int = 0
    rule_seconds: dict[str, float] = field(default_factory=dict)  # each rule's pass of the first apply
    hung_in: str = ""  # the rule whose pass was running when the file hung


# ---- the zoos ----------------------------------------------------------------------------------------------
def _package_dir(name: str) -> Path | None:
    """The installed package's folder, found without importing it (timm's import fails on a CPU torch)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _transformers_files(root: Path) -> list[Path]:
    return sorted(root.glob("models/*/modeling_*.py"))


def _timm_files(root: Path) -> list[Path]:
    # the public model files; `_builder.py`, `_registry.py` & co. are timm's machinery, not models
    return sorted(p for p in root.glob("models/*.py") if not p.name.startswith("_"))


def _vit_pytorch_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*.py") if p.name != "__init__.py")


ZOOS = {"transformers": _transformers_files, "timm": _timm_files, "vit_pytorch": _vit_pytorch_files}


def discover(zoos: Iterable[str] = tuple(ZOOS), say=print) -> list[ModelFile]:  # noqa: ANN001 - a print
    """Every model file of the installed zoos; a zoo that is not installed is skipped, and `say` says so."""
    found: list[ModelFile] = []
    for zoo in zoos:
        root = _package_dir(zoo)
        if root is None:
            say(f"skipped zoo {zoo}: not installed")
            continue
        files = ZOOS[zoo](root)
        say(f"zoo {zoo}: {len(files)} files ({root})")
        found += [ModelFile(zoo, p.relative_to(root).as_posix(), p) for p in files]
    return found


def sample(files: Sequence[ModelFile], n: int | None, match: Sequence[str] = ()) -> list[ModelFile]:
    """The files whose name contains one of `match` (all if none), then a deterministic sample of `n`: the
    first n by a hash of their name, so the sample is spread over the zoos and stable across runs."""
    chosen = [f for f in files if not match or any(m in f.key for m in match)]
    if n is not None and n < len(chosen):
        chosen = sorted(chosen, key=lambda f: hashlib.sha1(f.key.encode()).hexdigest())[:n]
    return sorted(chosen, key=lambda f: f.key)


# ---- one file, in its own process --------------------------------------------------------------------------
def _apply_all(path: Path, write: bool):  # noqa: ANN202 - engine.ApplyResult
    """What `opadvisor apply --rule all --unsafe FILE` (or with --diff: write=False) runs."""
    from opadvisor.rewrite import engine

    return engine.apply_files("all", [path], allow_unsafe=True, write=write)


def _rule_errors(messages: Sequence[str]) -> list[str]:
    return [m for m in messages if m.startswith("error:")]


def _over_budget(result) -> list[str]:  # noqa: ANN001 - engine.ApplyResult
    """The lines where a rule says it skipped part of the file because its analysis ran over budget."""
    notes = [
        f"{r.rule}:{n.line}: {n.message}"
        for f in result.files
        for r in f.rules
        for n in (*r.skipped, *r.notes)
    ]
    return [m for m in (*result.messages, *notes) if "over budget" in m]


def _first_apply(path: Path, out: Outcome) -> bool:
    """The apply that rewrites the file; False when it did not finish normally (the outcome says why)."""
    from opadvisor.errors import UserError

    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        result = _apply_all(path, write=True)
    except UserError as exc:
        out.status, out.exit_status, out.detail = "usererror", 2, str(exc)
        return False
    except BaseException:  # noqa: BLE001 - a crash of any kind is what this check is for
        out.status, out.exit_status, out.detail = "crash", 1, traceback.format_exc()[-4000:]
        return False
    finally:
        out.seconds = round(time.process_time() - cpu_start, 3)
        out.wall_seconds = round(time.perf_counter() - start, 3)
    out.exit_status = 0
    out.rule_errors = _rule_errors(result.messages)
    out.over_budget = _over_budget(result)
    out.changed_by = sorted({r.rule for f in result.files for r in f.rules if r.before != r.after})
    if not result.changed:
        out.status = "unchanged"
    return True


def _check_rewrite(path: Path, out: Outcome) -> None:
    """The rewritten file compiles, and a second apply over it changes nothing."""
    source = path.read_bytes()
    try:
        compile(source, str(path), "exec")
    except SyntaxError as exc:
        out.status, out.detail = "noncompiling", f"{exc.__class__.__name__}: {exc}"
        return
    start = time.process_time()
    try:
        again = _apply_all(path, write=False)
    except BaseException:  # noqa: BLE001
        out.status, out.detail = "unstable", "the second apply failed:\n" + traceback.format_exc()[-3000:]
        return
    finally:
        out.second_seconds = round(time.process_time() - start, 3)
    if again.changed:
        rules = sorted({r.rule for f in again.files for r in f.rules if r.before != r.after})
        out.status = "unstable"
        out.detail = (
            f"a second apply rewrote it again ({', '.join(rules)}):\n" + again.changed[0].diff()[:3000]
        )


def check_file(model: ModelFile, folder: Path) -> Outcome:
    """Copy `model` into `folder` (its own) as the user's file and check it there (in this process)."""
    target = folder / Path(model.rel).name
    shutil.copyfile(model.path, target)
    out = Outcome(model.key, lines=target.read_bytes().count(b"\n"))
    previous = Path.cwd()
    os.chdir(folder)  # static mode's state (.opadvisor/static) goes into the project: the temp folder
    try:
        if _first_apply(target, out) and out.status == "ok":
            _check_rewrite(target, out)
    finally:
        os.chdir(previous)
    return out


def _time_rules(folder: Path, seconds: dict[str, float]) -> None:
    """Time each rule's pass (engine.rewrite_source, one call per rule) and leave the running rule's name in
    folder/rule.txt, so a hang names its rule. Measurement only: the pass itself is untouched."""
    from opadvisor.rewrite import engine

    inner = engine.rewrite_source

    def timed(text, rule, *args, **kwargs):  # noqa: ANN001, ANN202 - engine.rewrite_source's own signature
        (folder / "rule.txt").write_text(rule)
        start = time.process_time()
        try:
            return inner(text, rule, *args, **kwargs)
        finally:
            seconds[rule] = round(seconds.get(rule, 0.0) + time.process_time() - start, 3)

    engine.rewrite_source = timed


def _child(conn, model: ModelFile, folder: Path, mem_gb: float) -> None:  # noqa: ANN001 - a Connection
    seconds: dict[str, float] = {}
    _time_rules(folder, seconds)
    if mem_gb > 0:
        limit = int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    stacks = open(folder / "stack.txt", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=False)
    try:
        outcome = check_file(model, folder)
        outcome.rule_seconds = seconds  # the second apply's passes are added in: both count
        conn.send(asdict(outcome))
    finally:
        conn.close()


# ---- the source-word filter changes nothing (rewrite/_relevance.py) --------------------------------------------
def _passes(source: bytes, path: Path) -> list[tuple]:
    """Every fixable rule's static pass over `source` (each on the same text): what it writes and says."""
    from opadvisor.errors import UserError
    from opadvisor.rewrite import engine, registry

    out = []
    for rule in registry.fixable_rules():
        try:
            after, r = engine.rewrite_source(source, rule, None, path, allow_unsafe=True)
        except UserError as exc:
            out.append((rule, "error", str(exc)))
            continue
        said = [(n.line, n.message) for n in (*r.changes, *r.skipped, *r.notes)]
        out.append((rule, hashlib.sha256(after).hexdigest(), said, r.already))
    return out


def filter_differences(path: Path) -> list[str]:
    """The rules whose static pass over `path` writes or says anything else with the source-word filter
    than without it (every top-level statement read, no file skipped); [] when none. No time budget."""
    from unittest import mock

    from opadvisor.rewrite import engine

    source = path.read_bytes()
    with mock.patch.dict(os.environ, {"OPADVISOR_ANALYSIS_BUDGET_S": "100000"}):
        filtered = _passes(source, path)
        with engine.unfiltered():
            unfiltered = _passes(source, path)
    return [f"{a[0]}: {a[1:]} != {b[1:]}" for a, b in zip(filtered, unfiltered, strict=True) if a != b]


def _apply_said(path: Path) -> tuple:
    """`apply --rule all --unsafe FILE` (not written): the text it would write and what it says."""
    from opadvisor.errors import UserError
    from opadvisor.rewrite import engine

    try:
        result = engine.apply_files("all", [path], allow_unsafe=True, write=False)
    except UserError as exc:
        return ("error", str(exc))
    files = [(f.after, [(r.rule, r.before != r.after) for r in f.rules]) for f in result.files]
    rules = [
        (r.rule, [(n.line, n.where, n.message) for n in (*r.changes, *r.skipped, *r.notes)], r.already)
        for f in result.files
        for r in f.rules
    ]
    return files, sorted(result.messages), sorted(rules)


def merge_differences(path: Path) -> list[str]:
    """How `apply --rule all` over `path` (every rule's first pass on the original, put together) differs
    from running each rule on the text the one before left (engine.sequential()); [] when it does not:
    the text written, the messages, each rule's changes, skips and notes. No time budget."""
    from unittest import mock

    from opadvisor.rewrite import engine

    with mock.patch.dict(os.environ, {"OPADVISOR_ANALYSIS_BUDGET_S": "100000"}):
        merged = _apply_said(path)
        with engine.sequential():
            one_by_one = _apply_said(path)
    if merged[0] == "error" or one_by_one[0] == "error":
        return [] if merged == one_by_one else [f"error: {merged} != {one_by_one}"]
    out = []
    if [f[0] for f in merged[0]] != [f[0] for f in one_by_one[0]]:
        out.append("the text written differs")
    if merged[1] != one_by_one[1]:
        out.append(f"messages: {merged[1]} != {one_by_one[1]}")
    if merged[2] != one_by_one[2]:
        diff = [f"{a} != {b}" for a, b in zip(merged[2], one_by_one[2], strict=False) if a != b]
        out.append("rules said: " + "; ".join(diff[:3]))
    return out


def _differences(model: ModelFile, merge: bool = False) -> tuple[str, list[str]]:
    return model.key, (merge_differences if merge else filter_differences)(model.path)


def compare_outputs(files: Sequence[ModelFile], jobs: int, merge: bool = False) -> int:
    """`--compare-filter` (filter_differences) or `--compare-merge` (merge_differences) on every file, J at a
    time; 1 when any file differs."""
    what = "merged and one rule at a time" if merge else "with and without the source-word filter"
    print(f"comparing {len(files)} files {what}, {jobs} at a time")
    differing = 0
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for key, diffs in pool.imap_unordered(functools.partial(_differences, merge=merge), files):
            differing += bool(diffs)
            print(
                f"{'DIFFERS' if diffs else 'same':<8} {key}",
                *diffs[:3],
                sep="\n    " if diffs else "",
                flush=True,
            )
    print(f"{differing} of {len(files)} files differ")
    return 1 if differing else 0


# ---- many files, J processes at a time ------------------------------------------------------------------------
@dataclass
class _Running:
    model: ModelFile
    process: multiprocessing.Process
    conn: object
    folder: Path
    started: float


def _cpu_seconds(pid: int) -> float:
    """CPU time a process has used (Linux /proc; elsewhere 0, and the wall-clock cap decides). A hang is
    judged on CPU time so that a loaded machine (2 cores shared) does not turn slow files into hangs."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hang_outcome(job: _Running, timeout: float) -> Outcome:
    """Dump the stuck process's stack (where it hangs), then kill it."""
    os.kill(job.process.pid, signal.SIGUSR1)
    time.sleep(0.5)
    job.process.kill()
    job.process.join()
    stack = _read(job.folder / "stack.txt")
    rule = _read(job.folder / "rule.txt")
    detail = f"no answer in {timeout:g} CPU s, in rule {rule or '?'}; stack: {_where(stack)}"
    lines = job.model.path.read_bytes().count(b"\n")
    return Outcome(job.model.key, "hang", detail=detail, lines=lines, hung_in=rule)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _where(stack: str) -> str:
    """The innermost frame and the innermost frames inside opadvisor of a faulthandler dump."""
    frames = [
        line.strip().replace("File ", "", 1)
        for line in stack.splitlines()
        if line.strip().startswith("File ")
    ]
    ours = [f for f in frames if "/opadvisor/" in f or "/rewrite/" in f][:6]
    return " <- ".join([frames[0], *ours] if frames else ["(no stack)"])


def _finish(job: _Running) -> Outcome:
    try:
        record = job.conn.recv() if job.conn.poll() else None
    except EOFError:
        record = None
    job.process.join()
    if record is None:  # died without a word: a signal, the memory limit hit in C, os._exit
        return Outcome(
            job.model.key, "crash", 1, detail=f"the process died (exit code {job.process.exitcode})"
        )
    return Outcome(**record)


def run_files(
    files: Sequence[ModelFile],
    *,
    jobs: int = 1,
    timeout: float = 60.0,
    mem_gb: float = 8.0,
    progress=None,  # noqa: ANN001 - called with each Outcome as it comes
) -> list[Outcome]:
    """Check every file, `jobs` processes at a time, each in a temp folder of its own."""
    import opadvisor.rewrite.engine  # noqa: F401 - loaded once here, so each forked check times only the apply

    context = multiprocessing.get_context("fork")
    pending, running, done = list(files), [], []
    with tempfile.TemporaryDirectory(prefix="opadvisor-eco-") as tmp:
        while pending or running:
            while pending and len(running) < jobs:
                model = pending.pop(0)
                folder = Path(tmp) / f"{len(done) + len(running):05d}"
                folder.mkdir()
                parent, child = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(child, model, folder, mem_gb), daemon=True)
                process.start()
                child.close()
                running.append(_Running(model, process, parent, folder, time.monotonic()))
            time.sleep(0.05)
            for job in list(running):
                if job.conn.poll() or not job.process.is_alive():
                    outcome = _finish(job)
                elif _cpu_seconds(job.process.pid) > timeout or time.monotonic() - job.started > 4 * timeout:
                    outcome = _hang_outcome(job, timeout)
                else:
                    continue
                running.remove(job)
                shutil.rmtree(job.folder, ignore_errors=True)
                done.append(outcome)
                if progress is not None:
                    progress(outcome)
    return sorted(done, key=lambda o: o.file)


# ---- the summary ------------------------------------------------------------------------------------------------
def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(outcomes: Sequence[Outcome], timeout: float) -> dict:
    """Counts by status and the apply times; a hang counts as the timeout in the percentiles."""
    times = [
        timeout if o.status == "hang" else o.seconds
        for o in outcomes
        if o.seconds is not None or o.status == "hang"
    ]
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "unchanged", "usererror", *BAD)}
    return {
        "files": len(outcomes),
        **counts,
        "rule_errors": sum(len(o.rule_errors) for o in outcomes),
        "files_over_budget": sum(bool(o.over_budget) for o in outcomes),
        "rules_over_budget": sum(len(o.over_budget) for o in outcomes),
        "p50_s": _percentile(times, 0.5),
        "p95_s": _percentile(times, 0.95),
        "max_s": max(times) if times else None,
        "timeout_s": timeout,
        "slowest": [
            (o.file, o.seconds if o.seconds is not None else f">{timeout:g}")
            for o in sorted(outcomes, key=lambda o: -(o.seconds if o.seconds is not None else 1e9))[:10]
        ],
    }


def print_summary(summary: dict, outcomes: Sequence[Outcome]) -> None:
    s = summary
    print(
        f"\n{s['files']} files: {s['ok']} rewritten and checked, {s['unchanged']} unchanged, "
        f"{s['usererror']} refused (user error), {s['hang']} hangs (> {s['timeout_s']:g} s), {s['crash']} crashes, "
        f"{s['noncompiling']} non-compiling rewrites, {s['unstable']} unstable second applies; "
        f"{s['rule_errors']} rule errors inside --rule all; {s['files_over_budget']} files where "
        f"{s['rules_over_budget']} rule passes gave up (source analysis over budget)"
    )
    if s["p50_s"] is not None:
        print(
            f"apply CPU time per file (a hang counted as the timeout): p50 {s['p50_s']:.2f} s, "
            f"p95 {s['p95_s']:.2f} s, max {s['max_s']:.2f} s"
        )
    print(
        "slowest: " + ", ".join(f"{f} {t if isinstance(t, str) else f'{t:.1f}'} s" for f, t in s["slowest"])
    )
    for o in outcomes:
        if o.over_budget:
            print(f"  over budget  {o.file}: {len(o.over_budget)} rules, e.g. {o.over_budget[0][:160]}")
        if o.status in BAD or o.status == "usererror" or o.rule_errors:
            first = (o.detail.strip().splitlines() or [""])[-1][:200]
            extra = f" rule errors: {'; '.join(e[:160] for e in o.rule_errors)}" if o.rule_errors else ""
            print(f"  {o.status:<12} {o.file}: {first}{extra}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=None, help="check a deterministic sample of N files")
    parser.add_argument(
        "--match", action="append", default=[], help="only files whose zoo/path contains this"
    )
    parser.add_argument("--zoo", action="append", choices=sorted(ZOOS), help="only these zoos (default: all)")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a file counts as a hang")
    parser.add_argument("--mem-gb", type=float, default=8.0, help="address-space limit per file (0: none)")
    parser.add_argument("--out", type=Path, help="write every file's record and the summary here (JSON)")
    parser.add_argument(
        "--compare-filter",
        action="store_true",
        help="instead: check that the source-word filter changes no rule's output on each file",
    )
    parser.add_argument(
        "--compare-merge",
        action="store_true",
        help="instead: check that `--rule all` with every rule's first pass on the original, put together, "
        "writes and says what one rule at a time does",
    )
    args = parser.parse_args(argv)

    files = sample(discover(args.zoo or tuple(ZOOS)), args.sample, args.match)
    if args.compare_filter or args.compare_merge:
        return compare_outputs(files, args.jobs, merge=args.compare_merge)
    print(f"checking {len(files)} files, {args.jobs} at a time, {args.timeout:g} s each at most", flush=True)

    partial = args.out.with_suffix(".partial.jsonl") if args.out else None
    if partial is not None:
        partial.write_text("")

    def progress(o: Outcome) -> None:
        took = f"{o.seconds:.2f} s" if o.seconds is not None else "-"
        print(f"{o.status:<12} {took:>9}  {o.file}", flush=True)
        if partial is not None:  # a run cut short (a command's time limit) keeps what it checked
            with partial.open("a") as f:
                f.write(json.dumps(asdict(o)) + "\n")

    outcomes = run_files(files, jobs=args.jobs, timeout=args.timeout, mem_gb=args.mem_gb, progress=progress)
    summary = summarize(outcomes, args.timeout)
    print_summary(summary, outcomes)
    if args.out:
        payload = {"summary": summary, "python": sys.version, "files": [asdict(o) for o in outcomes]}
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")
    return 1 if any(summary[s] for s in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The HTML page of `opadvisor report`: one self-contained file (inline style and script, nothing fetched).

    from opadvisor.report.html import build_html
    page = build_html(run_dir, profiles, report, display=display_path, apply_command=apply_command)

Sections: the run (script, device, steps, step time); the step breakdown as one bar; the findings ranked
as `suggest` ranks them, a table and then one card each with the source lines around file:line
(highlighted), the library frame and the user's call site where the finding has them, the evidence and
the `opadvisor apply` command; a picture of one step in time (GPU busy and idle and the longest kernels,
or on a CPU profile the CPU ops); step times per rank for multi-rank runs; the rules' notes.

Everything taken from source files and profiles (code, paths, op and kernel names, messages) is escaped:
source through Pygments, the rest through `html.escape`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.profile.model import Profile
from opadvisor.report.svg import KIND_COLOURS, timeline_svg
from opadvisor.rules.engine import Report
from opadvisor.rules.finding import Finding
from opadvisor.rules.overview import fmt_ms, fmt_share

__all__ = ["build_html"]

CONTEXT_LINES = 4  # source lines shown around a finding's lines
MAX_SNIPPET_LINES = 40  # a finding spanning a whole function shows its start
PART_COLOURS = {
    "matrix products": "#3b7dd8",
    "memory-bound elementwise": "#8e6bd8",
    "launch-bound gaps": "#e4572e",
    "GPU idle": "#f28e6b",
    "data loading": KIND_COLOURS["data"],
    "other ops": "#8e6bd8",
    "Python and framework": "#b8c2cc",
}


def build_html(
    run_dir: Path,
    profiles: Sequence[Profile],
    report: Report,
    *,
    display: Callable[[str], str] = str,
    apply_command: Callable[[Finding], str | None] = lambda f: None,
) -> str:
    """The whole page for one run (profiles in rank order) and its analysis."""
    first = profiles[0]
    body = [
        _header(run_dir, profiles, display),
        _breakdown_section(first),
        _findings_section(
            report.findings, len(profiles) > 1, display, apply_command, Sources(run_dir, first)
        ),
        _timeline_section(first, display),
    ]
    if len(profiles) > 1:
        body.append(_ranks_section(profiles))
    body.append(_notes_section(report, first))
    from opadvisor import __version__

    title = f"opadvisor report: {Path(first.script).name or run_dir.name}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # nothing on this page may be fetched: it must open offline and leak nothing
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape(title)}</title><style>{_css()}</style></head><body>"
        + "".join(body)
        + f"<footer>opadvisor {escape(__version__)} · self-contained page: nothing is fetched</footer>"
        + f"<script>{SCRIPT}</script></body></html>\n"
    )


# ---- header and breakdown ------------------------------------------------------------------------


def _device(p: Profile) -> str:
    env = p.environment
    return env.gpu_name if env.device == "cuda" and env.gpu_name else "CPU (no GPU times)"


def _header(run_dir: Path, profiles: Sequence[Profile], display: Callable[[str], str]) -> str:
    from opadvisor.rules.overview import step_words

    p = profiles[0]
    ranks = f" · {len(profiles)} ranks" if len(profiles) > 1 else ""
    facts = [
        ("script", display(p.script) + (" " + " ".join(p.argv[1:]) if len(p.argv) > 1 else "")),
        ("run", display(str(run_dir))),
        ("device", _device(p) + ranks),
        (
            "steps",
            f"{len(p.steps)} recorded after {p.warmup_steps} warm-up ({p.step_detection.replace('_', ' ')})",
        ),
        ("step time", step_words(p)),
        ("profiled", f"{p.created} · torch {p.environment.torch} · Python {p.environment.python}"),
    ]
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in facts)
    warn = ""
    if not p.complete:
        warn = (
            f'<p class="warn">Incomplete run: {len(p.steps)} of {p.steps_requested} steps were recorded '
            "(the script ended or failed inside the window).</p>"
        )
    return f'<header><h1>opadvisor report</h1><table class="facts">{rows}</table>{warn}</header>'


def _sentence(words: str) -> str:
    return words[:1].upper() + words[1:]


def _breakdown_section(p: Profile) -> str:
    from opadvisor.rules.overview import breakdown, step_words

    bd = breakdown(p)
    parts = [q for q in bd["parts"] if q["ms"]]
    total = sum(q["ms"] for q in parts) or 1.0
    basis = (
        "the GPU's time"
        if bd["basis"] == "gpu"
        else "what ran at each instant on the CPU, on any thread (a CPU profile has no GPU times)"
    )
    if bd["calibrated"]:
        basis += ", its idle parts scaled to the plain step (timed without the profiler)"
    basis += f"; the shares are of {bd['of']}, {fmt_ms(bd['total_ms'])}"
    segs, legend = [], []
    for q in parts:
        colour = PART_COLOURS.get(q["name"], "#999")
        words = f"{q['name']}: {fmt_ms(q['ms'])} ({fmt_share(q['share'])})"
        segs.append(
            f'<div class="seg" style="width:{q["ms"] / total * 100:.3f}%;background:{colour}" '
            f'title="{escape(words)}"></div>'
        )
        legend.append(
            f'<li><span class="swatch" style="background:{colour}"></span>{escape(q["name"])} '
            f"<b>{escape(fmt_ms(q['ms']))}</b> ({escape(fmt_share(q['share']))})</li>"
        )
    return (
        '<section id="breakdown"><h2>Where the step goes</h2>'
        f"<p>{escape(_sentence(step_words(p)))}, split by {escape(basis)}.</p>"
        f'<div class="bar" role="img" aria-label="step breakdown">{"".join(segs)}</div>'
        f'<ul class="legend">{"".join(legend)}</ul></section>'
    )


# ---- findings ------------------------------------------------------------------------------------


def _where(f: Finding, display: Callable[[str], str]) -> str:
    """file:line(-end); a library file by its path within site-packages."""
    lib = _library(f)
    path = str(lib["file"]) if lib else display(f.path)
    return f"{path}:{f.lines()}"


def _findings_section(
    findings: list[Finding],
    multi: bool,
    display: Callable[[str], str],
    apply_command: Callable,
    sources: Sources,
) -> str:
    if not findings:
        return (
            '<section id="findings"><h2>Findings</h2>'
            '<table id="findings-table" class="findings"><tbody><tr><td>No findings: every rule that '
            "could judge this run found nothing to fix.</td></tr></tbody></table></section>"
        )
    rows = []
    for i, f in enumerate(findings, 1):
        basis = " cpu" if f.evidence.time_basis == "cpu" else ""
        rows.append(
            f'<tr data-target="finding-{i}"><td class="num">{i}</td>'
            f"<td class=num>{escape(fmt_ms(f.time_ms_per_step) + basis)}</td>"
            f"<td class=num>{escape(fmt_share(f.evidence.share_of_step))}</td>"
            f"<td class=num>{escape(fmt_ms(f.est_saving_ms_per_step))}</td>"
            f"<td><code>{escape(f.rule)}</code></td>"
            f'<td><a href="#finding-{i}">{escape(_where(f, display))}</a></td>'
            f'<td><span class="fix {escape(f.fix)}">{escape(f.fix)}</span></td>'
            f"<td>{escape(f.message)}</td></tr>"
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("#", "time/step", "share", "saving", "rule", "where", "fix", "what it found")
    )
    cards = "".join(
        _finding_card(i, f, multi, display, apply_command, sources) for i, f in enumerate(findings, 1)
    )
    return (
        f'<section id="findings"><h2>Findings ({len(findings)}), by measured time per step</h2>'
        f'<table id="findings-table" class="findings"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>{cards}</section>"
    )


def _finding_card(
    i: int, f: Finding, multi: bool, display: Callable[[str], str], apply_command: Callable, sources: Sources
) -> str:
    parts = [
        f'<h3><span class="idx">{i}</span> <code>{escape(f.rule)}</code> at {escape(_where(f, display))}</h3>'
    ]
    parts.append(f"<p>{escape(f.message)}</p>")
    if multi and f.ranks:
        parts.append(
            f"<p>Found on rank{'s' if len(f.ranks) > 1 else ''} {escape(', '.join(map(str, f.ranks)))}.</p>"
        )
    library = _library(f)
    if library is None:
        parts.append(_source_block(sources, f.path, f.line, f.end_line, "source"))
    else:
        parts += _library_parts(f, library, sources, display)
    parts.append(_evidence(f))
    cmd = apply_command(f)
    if cmd:
        parts.append(
            f'<div class="apply"><span>fix ({escape(f.fix)}):</span> <code class="cmd">{escape(cmd)}</code>'
            '<button type="button" class="copy">copy</button></div>'
        )
        if f.advice and f.est_saving_ms_per_step == 0:
            parts.append(f"<p>No saving claimed here: {escape(f.advice)}</p>")
    elif f.fix_blocked:  # the dry run's verdict, in suggest's and apply's words
        parts.append(f'<div class="apply"><span>fix:</span> {escape(f.verdict())}</div>')
    elif f.advice:
        parts.append(f'<div class="apply"><span>what to do:</span> {escape(f.advice)}</div>')
    return f'<article class="finding" id="finding-{i}">{"".join(parts)}</article>'


def _library(f: Finding) -> dict[str, Any] | None:
    """The finding's `library` block when its pattern is written in an installed library, else None.

    Then `f.path`/`f.line` are the library file's and the block names the package, the path within
    site-packages, the function and module class, the user's call site and where the model is built
    (opadvisor/rules/_library.py). Findings without it (user code, older runs) show their own lines.
    """
    lib = getattr(f, "library", None)
    return lib if isinstance(lib, dict) and lib.get("file") else None


def _library_parts(
    f: Finding, lib: dict[str, Any], sources: Sources, display: Callable[[str], str]
) -> list[str]:
    """The library's lines where the pattern is written, then the user's line that called into it."""
    package = " ".join(str(x) for x in (lib.get("package"), lib.get("version")) if x)
    owner = f" of <code>{escape(str(lib['module_class']))}</code>" if lib.get("module_class") else ""
    function = escape(str(lib.get("function") or f.function or "?"))
    parts = [
        f'<p class="lib">In library code: <code>{function}</code>{owner} in {escape(package)} '
        f"({escape(_where(f, display))}).</p>",
        _source_block(sources, f.path, f.line, f.end_line, "library source"),
    ]
    call = lib.get("called_from")
    if isinstance(call, dict) and call.get("path") and isinstance(call.get("line"), int):
        parts.append(
            _source_block(sources, call["path"], call["line"], call["line"], "called from (your code)")
        )
    model = lib.get("model")
    if isinstance(model, dict) and model.get("path") and isinstance(model.get("line"), int):
        label = f"the model ({model.get('cls') or 'its class'}) is built here"
        parts.append(_source_block(sources, model["path"], model["line"], model["line"], label))
    return parts


def _evidence(f: Finding) -> str:
    ev = f.evidence
    items: list[tuple[str, str]] = []
    if ev.ops:
        items.append(("ops", " -> ".join(ev.ops)))
    if ev.kernel_count is not None:
        items.append(("kernels per step", str(ev.kernel_count)))
    basis = {"gpu": "GPU kernel time", "cpu": "CPU op time", "none": "not measured"}[ev.time_basis]
    items.append(("time per step", f"{fmt_ms(f.time_ms_per_step)} ({basis})"))
    items.append(("share of the step", fmt_share(ev.share_of_step)))
    if f.est_saving_ms_per_step is not None:
        items.append(("estimated saving", f"{fmt_ms(f.est_saving_ms_per_step)} per step"))
    if ev.occurrences != 1:
        items.append(("occurrences per step", str(ev.occurrences)))
    if ev.shapes:
        items.append(("shapes", ", ".join(str(list(s)) for s in ev.shapes[:6])))
    if ev.dtypes:
        items.append(("dtypes", ", ".join(ev.dtypes)))
    if f.module:
        items.append(("module", f.module))
    items += [("note", n) for n in ev.notes]
    rows = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in items)
    return f'<dl class="evidence">{rows}</dl>'


class Sources:
    """The source lines a finding points at, as they were when the run was profiled.

    A file that changed since (typically: `opadvisor apply` rewrote it) is read from apply's byte-exact
    backup in the run folder when that backup has the hash the profile recorded; otherwise the current
    file is shown with a warning that its lines may have moved.
    """

    def __init__(self, run_dir: Path, profile: Profile):
        self.recorded = profile.sources
        self.backups: dict[str, Path] = {}
        try:
            from opadvisor.verify.applied import load_applied

            applied = load_applied(run_dir)
        except UserError:  # nothing applied (the usual case), or an unusable applied.json
            return
        self.backups = {str(f.path): f.original for f in applied.files}

    def lines(self, path: str) -> tuple[list[str] | None, str | None]:
        """(lines, note): lines None when the file cannot be read; note says what is shown, if not plain."""
        from opadvisor.files import file_sha256

        want = self.recorded.get(path)
        now = file_sha256(path)
        if want is None or now == want:
            return _read_lines(Path(path)), None
        backup = self.backups.get(str(Path(path).resolve()))
        if backup is not None and file_sha256(backup) == want:
            note = "This file changed since it was profiled (opadvisor apply); shown as profiled, from apply's backup."
            return _read_lines(backup), note
        return _read_lines(Path(path)), "This file changed since it was profiled: the lines may have moved."


def _read_lines(path: Path) -> list[str] | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None


def _source_block(sources: Sources, path: str, line: int, end_line: int, label: str) -> str:
    """The lines around line..end_line of `path`, highlighted; a sentence instead when it cannot be read."""
    lines, note = sources.lines(path)
    if lines is None:
        return f'<p class="warn">{escape(label)}: {escape(path)} cannot be read here.</p>'
    if not 1 <= line <= len(lines):
        return f'<p class="warn">{escape(label)}: line {line} is past the end of {escape(path)}.</p>'
    first = max(1, line - CONTEXT_LINES)
    last = min(len(lines), max(line, end_line) + CONTEXT_LINES, first + MAX_SNIPPET_LINES - 1)
    more = max(line, end_line) - last
    tail = f'<div class="srclabel">... {more} more line(s) of the finding</div>' if more > 0 else ""
    warn = f'<p class="warn">{escape(note)}</p>' if note else ""
    return (
        f'<div class="srcblock"><div class="srclabel">{escape(label)}</div>{warn}'
        + _highlight("\n".join(lines[first - 1 : last]) + "\n", first, line, min(end_line, last))
        + tail
        + "</div>"
    )


def _highlight(code: str, first: int, line: int, end_line: int) -> str:
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    marked = list(range(line - first + 1, max(line, end_line) - first + 2))
    formatter = HtmlFormatter(
        linenos="inline", linenostart=first, hl_lines=marked, cssclass="src", wrapcode=True
    )
    return highlight(code, PythonLexer(), formatter)


# ---- timeline, ranks, notes ----------------------------------------------------------------------


def _timeline_section(p: Profile, display: Callable[[str], str]) -> str:
    from opadvisor.report.timeline import step_timeline

    tl = step_timeline(p)
    if tl is None:
        return '<section id="timeline"><h2>One step in time</h2><p>No step was recorded.</p></section>'
    if tl.basis == "gpu":
        intro = (
            f"Step {tl.step} (the median one): {fmt_ms(tl.duration_ms)} on the GPU's clock, GPU busy "
            f"{fmt_ms(tl.busy_ms)}, idle gaps {fmt_ms(tl.idle_ms)}. The numbers mark the longest kernels."
        )
        legend = [
            ("busy", "GPU busy"),
            ("idle", "GPU idle"),
            ("cpu", "the step on the CPU"),
            ("data", "data loading"),
        ]
        what = "kernel"
    else:
        intro = (
            f"CPU profile: there is no GPU timeline. Step {tl.step} (the median one), "
            f"{fmt_ms(tl.duration_ms)}: the CPU ops as they ran, forward and backward. The numbers mark "
            "the longest ops; profile on a GPU to see kernels and idle time."
        )
        legend, what = [], "op"
    keys = "".join(
        f'<li><span class="swatch" style="background:{KIND_COLOURS[k]}"></span>{escape(w)}</li>'
        for k, w in legend
    )
    rows = []
    for i, item in enumerate(tl.longest, 1):
        name = f'<td><code title="{escape(item.name)}">{escape(short_kernel_name(item.name))}</code></td>'
        op = f"<td><code>{escape(item.op)}</code></td>" if what == "kernel" else ""
        where = display(item.file) + ":" + str(item.line) if item.file else ""
        rows.append(
            f"<tr><td class=num>{i}</td><td class=num>{escape(fmt_ms(item.duration_us / 1000.0))}</td>"
            f"{name}{op}<td class=path>{escape(where)}</td></tr>"
        )
    op_head = "<th>launched by</th>" if what == "kernel" else ""
    longest = (
        f'<table class="longest"><thead><tr><th>#</th><th>time</th><th>{what}</th>{op_head}'
        f"<th>source</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
    return (
        f'<section id="timeline"><h2>One step in time</h2><p>{escape(intro)}</p>'
        f'{timeline_svg(tl)}<ul class="legend">{keys}</ul>{longest}</section>'
    )


def short_kernel_name(name: str) -> str:
    """A CUDA kernel's demangled name without return type, namespaces, template and call arguments.

    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>(...)" ->
    "multi_tensor_apply_kernel"; names without C++ decoration (e.g. "ampere_sgemm_128x64_nn") stay.
    """
    depth, out = 0, []
    for ch in name.replace("(anonymous namespace)", "anonymous"):
        if ch in "<(":
            if depth == 0 and ch == "(" and out and "".join(out).strip() not in ("", "void"):
                break
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    bare = "".join(out).strip()
    bare = bare.removeprefix("void ").strip()
    short = bare.rsplit("::", 1)[-1].strip()
    return short or name


def _ranks_section(profiles: Sequence[Profile]) -> str:
    from opadvisor.ranks import cross_rank

    cr = cross_rank.analyse(profiles)
    longest = max((r.step_ms for r in cr.ranks), default=0.0) or 1.0
    rows = []
    for r in cr.ranks:
        work = r.work_ms / longest * 100
        exposed = r.exposed_comm_ms / longest * 100
        bar = (
            f'<div class="rbar"><div style="width:{work:.2f}%;background:#3b7dd8" title="work"></div>'
            f'<div style="width:{exposed:.2f}%;background:#e4572e" title="exposed communication"></div></div>'
        )
        rows.append(
            f"<tr><td class=num>{r.rank}</td><td class=num>{escape(fmt_ms(r.step_ms))}</td>"
            f"<td class=num>{escape(fmt_ms(r.work_ms))}</td><td class=num>{escape(fmt_ms(r.exposed_comm_ms))}</td>"
            f"<td class=num>{escape(fmt_share(r.overlap))}</td><td class=barcell>{bar}</td></tr>"
        )
    missing = (
        f"<p class=warn>Ranks without a profile: {escape(', '.join(map(str, cr.missing_ranks)))}.</p>"
        if cr.missing_ranks
        else ""
    )
    extra = []
    if cr.straggler is not None:
        s = cr.straggler
        extra.append(
            f"Rank {s.rank} is a straggler: {fmt_ms(s.extra_ms)} more work per step ({fmt_share(s.share)} of the "
            f"step), slowest in {s.slowest_steps} of {s.steps} steps; the others wait {fmt_ms(s.others_wait_ms)}."
        )
    extra += [a.message for a in cr.advice] + cr.notes
    items = "".join(f"<li>{escape(t)}</li>" for t in extra)
    return (
        f'<section id="ranks"><h2>Step time per rank ({cr.world_size} ranks)</h2>'
        f"<p>Communication: {escape(cr.basis_detail)}. Bars: work (blue) and exposed "
        "communication (red), against the longest step.</p>"
        '<table class="ranks"><thead><tr><th>rank</th><th>step</th><th>work</th><th>exposed comm.</th>'
        f"<th>overlap</th><th></th></tr></thead><tbody>{''.join(rows)}</tbody></table>{missing}"
        f"<ul>{items}</ul></section>"
    )


def _notes_section(report: Report, p: Profile) -> str:
    items = [f"<li><code>{escape(n.rule)}</code>: {escape(n.message)}</li>" for n in report.notes]
    if not p.has_gpu:
        items.append(
            "<li>CPU profile: times are CPU op times; savings need kernel times: profile on a GPU.</li>"
        )
    rules = ", ".join(report.rules_run)
    return (
        f'<section id="notes"><h2>Notes</h2><ul>{"".join(items) or "<li>none</li>"}</ul>'
        f"<p>Rules run: {escape(rules)}.</p></section>"
    )


# ---- style and behaviour -------------------------------------------------------------------------


def _css() -> str:
    from pygments.formatters import HtmlFormatter

    return CSS + HtmlFormatter().get_style_defs(".src")


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1180px;padding:16px 24px;color:#1d232a;background:#fff}
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #dde3ea;padding-bottom:4px}
h3{font-size:15px;margin:0 0 6px}code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
table{border-collapse:collapse}th,td{text-align:left;padding:4px 8px;vertical-align:top}
table.facts th{color:#5b6672;font-weight:600;padding-left:0}
table.findings,table.longest,table.ranks{width:100%;border:1px solid #dde3ea}
table.findings thead th,table.longest thead th,table.ranks thead th{background:#f2f5f8;border-bottom:1px solid #dde3ea}
table.findings tbody tr{border-top:1px solid #eef1f4;cursor:pointer}table.findings tbody tr:hover{background:#f7faff}
td.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
.bar{display:flex;height:28px;border-radius:4px;overflow:hidden;border:1px solid #dde3ea}.bar .seg{height:100%}
ul.legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:6px 18px;margin:8px 0}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.fix{border-radius:3px;padding:0 5px;font-size:12px}.fix.safe{background:#dff3e4;color:#17622d}
.fix.unsafe{background:#fdebd3;color:#8a4b00}.fix.none{background:#eceff2;color:#4b5560}
article.finding{border:1px solid #dde3ea;border-radius:6px;padding:12px 14px;margin:14px 0}
article.finding:target,article.finding.flash{box-shadow:0 0 0 3px #9cc3f5}
.idx{display:inline-block;min-width:20px;text-align:center;background:#1d232a;color:#fff;border-radius:10px;padding:0 6px;font-size:12px}
.srcblock{margin:8px 0}.srclabel{font-size:12px;color:#5b6672;margin-bottom:2px}
.src pre{margin:0;padding:6px 0;overflow-x:auto;border:1px solid #e6eaee;border-radius:4px;font-size:12.5px}
.src .hll{background:#fff3b0;display:block}.src .linenos{color:#8a949e;padding:0 10px 0 8px;user-select:none}
dl.evidence{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dl.evidence dt{color:#5b6672}dl.evidence dd{margin:0;word-break:break-word}
.apply{background:#f2f5f8;border-radius:4px;padding:6px 10px;margin-top:6px}
.apply button{margin-left:8px;font-size:12px}.lib{color:#40307a}.warn{color:#8a4b00;background:#fff6e6;padding:4px 8px;border-radius:4px}
svg.timeline{display:block;margin:8px 0}svg .lane{font-size:12px;fill:#3a444e}svg .tick{font-size:11px;fill:#5b6672}
svg .lanebg{fill:#f4f6f8}svg .seglabel{font-size:11px;fill:#1d232a;pointer-events:none}td.path{word-break:break-all}svg .axis{stroke:#8a949e}svg .mark line{stroke:#1d232a;stroke-width:1}
svg .mark text{font-size:11px;font-weight:700;fill:#1d232a}
.rbar{display:flex;height:14px;width:320px;background:#f4f6f8}.rbar div{height:100%}
footer{margin:32px 0 8px;color:#8a949e;font-size:12px}
"""

# Clicking a findings row opens its card; "copy" puts the apply command on the clipboard where allowed.
SCRIPT = """
(function () {
  document.querySelectorAll('#findings-table tbody tr[data-target]').forEach(function (row) {
    row.addEventListener('click', function (ev) {
      if (ev.target.tagName === 'A') return;
      var card = document.getElementById(row.getAttribute('data-target'));
      if (!card) return;
      card.scrollIntoView({behavior: 'smooth', block: 'start'});
      card.classList.add('flash');
      setTimeout(function () { card.classList.remove('flash'); }, 1200);
    });
  });
  document.querySelectorAll('button.copy').forEach(function (btn) {
    btn.addEventListener('click', function () {
      var text = btn.parentNode.querySelector('code.cmd').textContent;
      var done = function () { btn.textContent = 'copied'; };
      if (navigator.clipboard && navigator.clipboard.writeText) {
        navigator.clipboard.writeText(text).then(done, function () { btn.textContent = 'select and copy'; });
      } else {
        btn.textContent = 'select and copy';
      }
    });
  });
})();
"""

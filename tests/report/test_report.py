"""`opadvisor report`: the HTML page, loaded in a real browser (headless Chromium), and what it holds.

The browser tests need Debian's Chromium (`apt-get install chromium`; .ci/run installs it); where it
cannot be installed they are skipped and say so. Screenshots go to the test's tmp folder, or to
$OPADVISOR_SCREENSHOTS when set (to look at them).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from chromium import Chromium, find_chromium
from fixture_profiles import load_fixture_profile
from report_testlib import REPO, write_run
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.profile.runs import load_run
from opadvisor.report.html import build_html, short_kernel_name
from opadvisor.report.timeline import step_timeline
from opadvisor.rules.engine import analyse

CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed and could not be (apt-get install chromium): the HTML report is not "
    "checked in a browser here",
)
ROWS = "document.querySelectorAll('#findings-table tbody tr[data-target]').length"


@pytest.fixture(scope="module")
def browser():
    with Chromium.start(CHROMIUM) as b:
        yield b


def render(run: Path, out: Path) -> Path:
    result = CliRunner().invoke(app, ["report", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "report written to" in result.output
    return out


def check_in_browser(browser, page_file: Path, shot: str) -> object:
    """Load the page: no script errors, nothing fetched but the page itself; save a screenshot."""
    page = browser.open(page_file.as_uri())
    assert page.errors == []
    assert page.requests == [page_file.as_uri()]
    assert page.evaluate("!!document.querySelector('#findings-table')")
    assert page.evaluate("!!document.querySelector('#breakdown .bar .seg')")
    folder = Path(os.environ.get("OPADVISOR_SCREENSHOTS") or page_file.parent)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(folder / f"{shot}.png")
    assert (folder / f"{shot}.png").stat().st_size > 10_000  # a picture, not an empty canvas
    return page


def suggest_count(run: Path) -> int:
    result = CliRunner().invoke(app, ["suggest", str(run), "--format", "json"])
    assert result.exit_code == 0, result.output
    return len(json.loads(result.stdout)["findings"])


@pytest.fixture
def gpu_run(tmp_path) -> Path:
    return write_run(tmp_path / "gpu", [load_fixture_profile("bert_train")])


@pytest.fixture
def two_rank_run(tmp_path) -> Path:
    ranks = []
    for rank in (0, 1):
        p = load_fixture_profile("bert_train")
        p.rank, p.world_size = rank, 2
        for s in p.steps:
            s.wall_ms *= 1.0 + 0.3 * rank  # rank 1 is slower
        ranks.append(p)
    return write_run(tmp_path / "ddp", ranks)


@needs_browser
@pytest.mark.slow
def test_example_report_in_chromium(browser, example_runs, tmp_path) -> None:
    """The bundled example's CPU run: findings as suggest ranks them, CPU ops instead of a GPU timeline,
    and the lines as profiled (from apply's backup) although apply has rewritten the file since."""
    page = check_in_browser(browser, render(example_runs.before, tmp_path / "cpu.html"), "example_cpu")
    assert page.evaluate(ROWS) == suggest_count(example_runs.before) > 0
    text = page.evaluate("document.body.innerText")
    assert "CPU profile: there is no GPU timeline" in text
    assert "shown as profiled, from apply's backup" in text
    assert "probs = F.softmax(scores, dim=-1)" in text  # the original line, not the rewritten one
    assert f"opadvisor apply --rule fused_softmax {example_runs.before}" in text
    lanes = page.evaluate("[...document.querySelectorAll('svg.timeline text.lane')].map(t => t.textContent)")
    assert any(name.startswith("forward") for name in lanes) and any(n.startswith("backward") for n in lanes)


@needs_browser
def test_gpu_report_in_chromium(browser, gpu_run, tmp_path) -> None:
    """A real H200 profile: GPU busy and idle in the timeline, the longest kernels with their ops."""
    page = check_in_browser(browser, render(gpu_run, tmp_path / "gpu.html"), "example_gpu")
    assert page.evaluate(ROWS) == suggest_count(gpu_run) > 0
    tl = step_timeline(load_run(str(gpu_run))[1][0])
    assert page.evaluate("document.querySelectorAll('#timeline table.longest tbody tr').length") == len(
        tl.longest
    )
    assert page.evaluate(
        "[...document.querySelectorAll('svg.timeline text.lane')].map(t => t.textContent)"
    ) == [
        "GPU",
        "CPU",
    ]
    assert page.evaluate("document.querySelectorAll('svg.timeline .mark').length") == len(tl.longest)
    text = page.evaluate("document.body.innerText")
    assert "GPU busy" in text and "NVIDIA H200" in text
    # a click on a findings row brings its card into view
    page.evaluate("document.querySelector('#findings-table tbody tr[data-target]').click()")
    assert page.errors == []


@needs_browser
def test_multi_rank_report_in_chromium(browser, two_rank_run, tmp_path) -> None:
    page = check_in_browser(browser, render(two_rank_run, tmp_path / "ddp.html"), "example_two_ranks")
    rows = page.evaluate("[...document.querySelectorAll('#ranks tbody tr')].map(r => r.cells[0].textContent)")
    assert rows == ["0", "1"]
    assert "Rank 1 is a straggler" in page.evaluate("document.querySelector('#ranks').innerText")


@needs_browser
def test_untrusted_text_is_escaped(browser, tmp_path) -> None:
    """Source lines, kernel names and paths are shown as text: nothing in them runs or becomes markup."""
    profile = load_fixture_profile("bert_train")
    script = tmp_path / "bert_train.py"
    lines = (REPO / "examples" / "bert_train.py").read_text().splitlines()
    hostile = "  # </code></pre><script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"
    lines = [line + hostile if "masked_fill(~mask" in line else line for line in lines]
    script.write_text("\n".join(lines) + "\n")
    old = profile.script
    profile.script = str(script)
    profile.sources = {str(script) if k == old else k: v for k, v in profile.sources.items()}
    for op in profile.ops:
        op.file = str(script) if op.file == old else op.file
        for k in op.kernels:
            k.name = "<img src=x onerror='window.pwned = 3'>" + k.name
    run = write_run(tmp_path / "hostile", [profile])
    page = check_in_browser(browser, render(run, tmp_path / "hostile.html"), "hostile")
    assert page.evaluate("window.pwned === undefined")
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.querySelectorAll('script').length") == 1  # the page's own
    assert "<script>window.pwned = 1</script>" in page.evaluate(
        "document.querySelector('#findings').innerText"
    )


# ---- without a browser -----------------------------------------------------------------------------


def test_library_finding_shows_the_library_lines_and_the_call_site(gpu_run) -> None:
    """A finding in library code (the `library` block issue 17's attribution gives it) shows the library's
    lines where the pattern is written, the user's line that called it and where the model is built."""
    run_dir, profiles = load_run(str(gpu_run))
    report = analyse(profiles)
    f = report.findings[0]
    user_path, user_line = f.path, f.line
    f.path, f.line, f.end_line = (
        str(REPO / "opadvisor" / "rules" / "engine.py"),
        3,
        4,
    )  # stands in for a library file
    f.library = {
        "package": "transformers",
        "version": "5.0",
        "file": "transformers/models/bert/modeling_bert.py",
        "function": "BertSelfAttention.forward",
        "module_class": "transformers.models.bert.modeling_bert.BertSelfAttention",
        "called_from": {"path": user_path, "line": user_line},
        "model": {"path": user_path, "line": 1, "cls": "BertForMaskedLM"},
    }
    page = build_html(run_dir, profiles, report)
    assert "In library code: <code>BertSelfAttention.forward</code>" in page
    assert "transformers/models/bert/modeling_bert.py:3-4" in page
    for label in ("library source", "called from (your code)", "the model (BertForMaskedLM) is built here"):
        assert page.count(label) == 1
    assert page.count("In library code") == 1  # the other findings show their own source


def test_report_defaults_to_the_run_folder_and_refuses_a_folder(gpu_run) -> None:
    result = CliRunner().invoke(app, ["report", str(gpu_run)])
    assert result.exit_code == 0, result.output
    assert (gpu_run / "report.html").read_text().startswith("<!DOCTYPE html>")
    result = CliRunner().invoke(app, ["report", str(gpu_run), "-o", str(gpu_run)])
    assert result.exit_code == 2 and "is a folder" in result.output
    result = CliRunner().invoke(app, ["report", str(gpu_run / "nope")])
    assert result.exit_code == 2 and "no run folder" in result.output


def test_page_is_self_contained(gpu_run) -> None:
    run_dir, profiles = load_run(str(gpu_run))
    page = build_html(run_dir, profiles, analyse(profiles))
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "default-src 'none'" in page  # and the browser is told to fetch nothing


def test_timeline_of_a_gpu_step_adds_up() -> None:
    profile = load_fixture_profile("bert_train")
    tl = step_timeline(profile)
    step = profile.steps[tl.step]
    gpu = tl.lanes[0]
    busy = sum(s.end_us - s.start_us for s in gpu.segments if s.kind == "busy")
    idle = sum(s.end_us - s.start_us for s in gpu.segments if s.kind == "idle")
    assert abs(busy / 1000 - step.gpu_busy_ms) < 1e-6
    assert abs(idle - sum(g.duration_us for g in step.idle_gaps)) < 1e-6
    assert [k.duration_us for k in tl.longest] == sorted((k.duration_us for k in tl.longest), reverse=True)
    assert tl.longest[0].file and tl.longest[0].line


def test_short_kernel_names() -> None:
    assert short_kernel_name("ampere_sgemm_128x64_nn") == "ampere_sgemm_128x64_nn"
    assert (
        short_kernel_name(
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
            "namespace)::TensorListMetadata<2>, float>(at::native::TensorListMetadata<2>, float)"
        )
        == "multi_tensor_apply_kernel"
    )
    assert short_kernel_name("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    )

"""`opadvisor profile --nproc-per-node 2` on CPU (gloo): what every rank writes, and what a failing rank does.

Each launch starts torchrun and two Python processes (about 20 s on a small CI machine), so the launches
here are few: one run of the DDP example shared by several tests, and one per failure kind. Every
subprocess has a timeout: a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_testlib import Done, opadvisor_here

from opadvisor.profile.model import load_profile
from opadvisor.profile.runs import load_run, profile_paths
from opadvisor.ranks import cross_rank
from opadvisor.rules import engine

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp_train.py"
CRASH = Path(__file__).parent / "scripts" / "crash_ddp.py"
LAUNCH_TIMEOUT_S = 240


def opadvisor(cwd: Path, *args: str, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opadvisor", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("opadvisor: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def runs_in(cwd: Path) -> list[Path]:
    root = cwd / ".opadvisor" / "runs"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


@pytest.fixture(scope="module")
def ddp_run(made_once) -> tuple[Path, Done]:
    """The DDP example, 2 ranks on CPU; rank 1 sleeps 60 ms per step (a straggler to find). Launched once a
    test run (a module fixture launched it again on each xdist worker that ran one of its tests): (the
    folder it ran in, what the launch printed). The tests only read the folder."""

    def launch(folder: Path) -> None:
        (folder / "project").mkdir()
        proc = opadvisor(
            folder / "project", "profile", "--nproc-per-node", "2", "--steps", "3", "--warmup", "2", "--memory",
            str(EXAMPLE), "--", "--steps", "50", "--device", "cpu", "--slow-rank", "1", "--slow-ms", "60",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (folder / "stdout.txt").write_text(proc.stdout)
        (folder / "stderr.txt").write_text(proc.stderr)

    folder = made_once("ddp-example", launch)
    printed = Done(0, (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text())
    return folder / "project", printed


def test_every_rank_writes_its_profile_and_trace(ddp_run) -> None:
    cwd, proc = ddp_run
    (run_dir,) = runs_in(cwd)
    assert (cwd / ".opadvisor" / "latest").read_text().strip() == run_dir.name
    assert [p.name for p in profile_paths(run_dir)] == ["profile.rank0.json", "profile.rank1.json"]
    for rank in (0, 1):
        prof = load_profile(run_dir / f"profile.rank{rank}.json")
        assert (prof.rank, prof.world_size) == (rank, 2)
        assert prof.run_id == run_dir.name and prof.complete and len(prof.steps) == 3
        assert prof.step_detection == "optimizer_hook"
        assert prof.memory_requested and all(s.saved_bytes for s in prof.steps)  # --memory reached every rank
        assert any(o.name == "c10d::allreduce_" and o.is_backward for o in prof.ops)  # DDP's bucket
        assert any(a.name == "gloo:all_reduce" for a in prof.annotations)
        assert (run_dir / f"trace.rank{rank}.json.gz").stat().st_size > 0
        status = json.loads((run_dir / f"status.rank{rank}.json").read_text())
        assert status["status"] == "complete" and status["steps_recorded"] == 3 and status["world_size"] == 2
    assert not list(run_dir.glob(".*")), "no staging folder or launcher file left behind"
    # every rank stopped after the same step (warm-up 2 + 3 recorded): rank 0 printed 4 losses, not 50
    assert "step 4 loss" in proc.stdout and "step 5 loss" not in proc.stdout


def test_profile_prints_the_cross_rank_summary(ddp_run) -> None:
    _, proc = ddp_run
    out = proc.stdout
    assert "2 of 2 rank(s) on CPU" in out and "1 (slow)" in out and "[straggler] rank 1" in out
    assert "Rank 0:" in out and "Next: opadvisor suggest" in out
    assert "launching 2 rank(s) through torchrun" in proc.stderr


def test_cross_rank_analysis_of_the_written_profiles(ddp_run) -> None:
    cwd, _ = ddp_run
    _, profiles = load_run(None, cwd)
    report = cross_rank.analyse(profiles)
    assert report.basis == "cpu" and "gloo" in report.basis_detail and report.device == "CPU"
    assert [r.rank for r in report.ranks] == [0, 1] and not report.missing_ranks
    for r in report.ranks:
        assert r.steps == 3 and r.comm_ms > 0 and "all_reduce" in r.collectives
        assert r.calls_per_step["all_reduce"] == 2  # DDP's one bucket and the loop's loss all-reduce
    s = report.straggler
    assert s is not None and s.rank == 1 and s.extra_ms > 20  # slept 60 ms a step
    assert report.ranks[0].exposed_comm_ms > report.ranks[1].exposed_comm_ms  # rank 0 waits for it
    loop = [a for a in report.advice if a.id == "loop_collective"]
    line = next(i for i, t in enumerate(EXAMPLE.read_text().splitlines(), 1) if "dist.all_reduce(total)" in t)
    assert [(Path(a.path).resolve(), a.line) for a in loop] == [(EXAMPLE.resolve(), line)]
    data = json.loads(json.dumps(cross_rank.to_json(report)))
    assert data["straggler"]["rank"] == 1 and data["basis"] == "cpu"


def test_suggest_on_the_multi_rank_run(ddp_run) -> None:
    cwd, _ = ddp_run
    table = opadvisor_here(cwd, "suggest")
    assert table.returncode == 0, table.stderr
    assert "[straggler] rank 1" in table.stdout and "gloo" in table.stdout
    assert "ranks 0, 1" in table.stdout  # each merged finding says which ranks it holds for
    as_json = opadvisor_here(cwd, "suggest", "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["cross_rank"]["straggler"]["rank"] == 1 and data["cross_rank"]["basis"] == "cpu"
    assert all(f.get("ranks") for f in data["findings"])  # single-rank rules, merged with their ranks


def test_data_parallel_rules_quiet_on_the_ddp_example(ddp_run) -> None:
    """examples/ddp_train.py builds DDP with the default 25 MB buckets, no find_unused_parameters and one
    micro-batch per step: recorded at its line, and none of issue 34's rules fires."""
    cwd, _ = ddp_run
    _, profiles = load_run(None, cwd)
    for prof in profiles:
        (ddp,) = [c for c in prof.constructions if c.kind == "ddp"]
        assert ddp.line == next(
            i for i, t in enumerate(EXAMPLE.read_text().splitlines(), 1) if "DDP(model" in t
        )
        assert ddp.attrs["bucket_cap_mb"] == 25.0 and not ddp.attrs["find_unused_parameters"]
        assert ddp.attrs["grad_sync"]["per_step"][0] == [1, 1] and ddp.attrs["unused_params"] == 0
    quiet = {"ddp_find_unused", "ddp_small_bucket", "grad_accum_sync", "fsdp_root_only", "fsdp_fp32_gather"}
    report = engine.analyse(profiles, select=sorted(quiet))
    assert not report.findings
    assert {n.rule for n in report.notes} == {"fsdp_root_only", "fsdp_fp32_gather"}  # no fully_shard here


# ---- a failing rank: one error line naming it, exit 2, no hang ------------------------------------------


def test_rank_raising_inside_the_window(tmp_path: Path) -> None:
    """Rank 1 raises at its 3rd step (the 2nd recorded); rank 0 then loses its peer in the all-reduce.

    Both keep the steps they recorded (rank 1: one; rank 0: up to the failed step), so the run is whole
    and marked latest, as a single-process run that failed after recording is.
    """
    started = time.monotonic()
    proc = opadvisor(tmp_path, "profile", "--nproc-per-node", "2", "--steps", "3", "--warmup", "1", str(CRASH),
                     "--", "--crash-rank", "1", "--crash-step", "3", "--how", "raise")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert line.startswith("opadvisor: error: rank 1 (local rank 1")
    assert "raised ValueError: the user's own bug on rank 1 at step 3 after 2 step(s)" in line
    (run_dir,) = runs_in(tmp_path)
    # Rank 0 either sees its peer go in the all-reduce or is stopped by torchrun first: a race the
    # launcher decides. Its status file says which; the line names it second, never as the cause.
    status0 = json.loads((run_dir / "status.rank0.json").read_text())
    assert status0["status"] in ("script_error", "terminated")
    then = {"script_error": "failed because a peer went away", "terminated": "was stopped by the launcher"}
    assert f"then rank 0 {then[status0['status']]}" in line
    assert "torchrun exited with code 1" in line
    assert "ValueError: the user's own bug on rank 1 at step 3" in proc.stderr.split("opadvisor: error:")[0]
    assert "fail_here" in proc.stderr  # the user's traceback, shown once
    assert "ChildFailedError" not in proc.stderr  # torchrun's own traceback is replaced by the line
    assert "were kept in" in line and str(run_dir) in line
    prof1 = load_profile(run_dir / "profile.rank1.json")
    assert len(prof1.steps) == 1 and not prof1.complete and prof1.rank == 1
    assert (tmp_path / ".opadvisor" / "latest").read_text().strip() == run_dir.name
    report = cross_rank.analyse(load_run(None, tmp_path)[1])  # a failed run is still readable
    assert any("did not record the whole window" in n for n in report.notes)
    assert time.monotonic() - started < LAUNCH_TIMEOUT_S


def test_rank_killed_without_reporting(tmp_path: Path) -> None:
    """Rank 1 dies by SIGKILL (no Python cleanup, no status): named as the cause, not rank 0's peer error.

    Only rank 0 wrote a profile: the run is kept but not marked latest (a rank is missing).
    """
    proc = opadvisor(tmp_path, "profile", "--nproc-per-node", "2", "--steps", "3", "--warmup", "1", str(CRASH),
                     "--", "--crash-rank", "1", "--crash-step", "3", "--how", "kill")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert line.startswith("opadvisor: error: rank 1 (local rank 1") and "died (killed by SIGKILL)" in line
    (run_dir,) = runs_in(tmp_path)
    assert (run_dir / "profile.rank0.json").exists() and not (run_dir / "profile.rank1.json").exists()
    assert not (tmp_path / ".opadvisor" / "latest").exists()
    report = cross_rank.analyse(load_run(str(run_dir), tmp_path)[1])
    assert report.missing_ranks == [1]


def test_rank_exiting_before_the_window_leaves_nothing(tmp_path: Path) -> None:
    proc = opadvisor(tmp_path, "profile", "--nproc-per-node", "2", "--steps", "2", "--warmup", "3", str(CRASH),
                     "--", "--crash-rank", "0", "--crash-step", "2", "--how", "exit")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert "rank 0 (local rank 0" in line and "called sys.exit(3) after 1 step(s)" in line
    assert "no rank wrote a profile" in line
    assert runs_in(tmp_path) == [] and not (tmp_path / ".opadvisor" / "latest").exists()


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT as a terminal delivers it: a suite started in the background (`pytest &`) runs with SIGINT
    ignored, which every child inherits, and Python then never turns SIGINT into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_rank_even_blocked_ones(tmp_path: Path) -> None:
    """Rank 1 blocks in C++ (a recv nobody answers), rank 0 in the all-reduce: no Python handler can run
    on either. Ctrl-C: each rank's watchdog ends it within seconds, not torchrun's SIGKILL after 30 s.
    Blocked ranks cannot write what they recorded: nothing is kept."""
    marker = tmp_path / "blocking"
    cmd = [sys.executable, "-m", "opadvisor", "profile", "--nproc-per-node", "2", "--steps", "5", "--warmup", "1",
           str(CRASH), "--", "--crash-rank", "1", "--crash-step", "4", "--how", "block", "--marker", str(marker)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while time.monotonic() < deadline and not marker.exists() and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(3.0)  # let both ranks reach their blocking calls
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=90)
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, stderr
    assert "opadvisor: error: interrupted: the launcher stopped every rank; no rank wrote a profile" in stderr
    assert took < 25, took
    assert runs_in(tmp_path) == []


# ---- options ------------------------------------------------------------------------------------------


def test_two_nodes_on_one_machine_share_an_out_folder(tmp_path: Path) -> None:
    """--nnodes 2: one `opadvisor profile` per node, the same --out; each writes its own rank's files."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "shared-run"
    cmds = [
        [sys.executable, "-m", "opadvisor", "profile", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "--out", str(out), "--steps", "2",
         "--warmup", "1", str(CRASH), "--", "--crash-rank", "-1"]
        for node in (0, 1)
    ]  # fmt: skip
    procs = [
        subprocess.Popen(c, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in cmds
    ]
    try:
        results = [p.communicate(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    profiles = [load_profile(p) for p in profile_paths(out)]
    assert [(p.rank, p.world_size, len(p.steps)) for p in profiles] == [(0, 2, 2), (1, 2, 2)]
    assert not (tmp_path / ".opadvisor" / "latest").exists()  # --out runs are never marked latest


def test_bad_launch_options_are_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = opadvisor(tmp_path, "profile", "--nnodes", "2", str(EXAMPLE), timeout=60)
    assert proc.returncode == 2 and "--nnodes > 1 needs --master-addr" in error_line(proc)
    proc = opadvisor(tmp_path, "profile", "--nproc-per-node", "2", "missing.py", timeout=60)
    assert proc.returncode == 2 and "missing.py: no such file" in error_line(proc)
    assert not (tmp_path / ".opadvisor").exists() or runs_in(tmp_path) == []


# ---- on two GPUs (NCCL): `python3 -m pytest -m gpu tests/distributed` on a machine with 2+ GPUs -----------


@pytest.mark.gpu
def test_nccl_on_two_gpus(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    proc = opadvisor(
        tmp_path, "profile", "--nproc-per-node", "2", "--steps", "5", "--warmup", "3", str(EXAMPLE),
        "--", "--steps", "30", "--device", "cuda", "--slow-rank", "1", "--slow-ms", "20",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _, profiles = load_run(None, tmp_path)
    assert [(p.rank, p.world_size, p.has_gpu, len(p.steps)) for p in profiles] == [
        (0, 2, True, 5),
        (1, 2, True, 5),
    ]
    report = cross_rank.analyse(profiles)
    assert report.basis == "gpu", report.notes  # NCCL kernels reached the profiles
    for r in report.ranks:
        assert r.comm_ms > 0 and "all_reduce" in r.collectives
    assert report.straggler is not None and report.straggler.rank == 1

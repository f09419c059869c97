"""The parent side: run a script under the harness in a fresh process and read back what it recorded.

Each run is `python -m opadvisor.verify.harness` with the same interpreter as the caller, in the script's
working directory, with a config file in a private temporary folder (see `harness.py` for its fields).
The script's own output goes to files there (the tail is kept for error messages), not to the terminal.
The environment is the caller's plus `PYTHONHASHSEED=0` and, for the parity phase,
`CUBLAS_WORKSPACE_CONFIG=:4096:8` (needed by deterministic cuBLAS) unless already set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opadvisor.verify.harness import CONFIG_ENV, EXIT_SCRIPT_ERROR, rank_result_path

TAIL_CHARS = 4000


@dataclass
class ChildSpec:
    script: str  # absolute path
    argv: list[str]  # the script's argv, argv[0] included
    cwd: str
    steps: int
    mode: str  # "parity" | "timing"
    warmup: int = 0
    seed: int = 0
    sources: dict[str, str] = field(default_factory=dict)  # file -> the source to run instead (a backup)
    module: str | None = None  # run as this module, as `python -m` does (the profile's `module`)
    import_root: str | None = None  # sys.path[0] for a module
    grads_dir: str | None = None  # parity mode: where the harness writes the step-1 gradients
    # ranks to run through torchrun (standalone, this machine); 1: a plain process (issue 34)
    nproc: int = 1
    compile_backend: str | None = None  # timing with --compile: the model compiled in place by the harness


@dataclass
class ChildResult:
    returncode: int
    result: dict[str, Any] | None  # what the harness wrote (rank 0's); None when it wrote nothing
    output_tail: str  # the last lines of the script's stdout and stderr
    rank_results: dict[int, dict[str, Any]] = field(default_factory=dict)  # the other ranks' results

    @property
    def error(self) -> str | None:
        """Why this run cannot be used, in words; None when it ran."""
        if self.result is None:
            return f"the run failed before recording anything (exit {self.returncode}):\n{self.output_tail}"
        if self.result.get("exit") == "error":
            return str(self.result.get("error") or "the script failed")
        return None


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-TAIL_CHARS:].decode("utf-8", errors="replace")


def run_child(spec: ChildSpec, *, timeout: float | None = None) -> ChildResult:
    """Run the script under the harness; a timeout ends it and reports what it recorded so far (nothing)."""
    with tempfile.TemporaryDirectory(prefix="opadvisor-verify-") as tmp:
        tmpdir = Path(tmp)
        config = {
            "script": spec.script,
            "argv": spec.argv,
            "cwd": spec.cwd,
            "steps": spec.steps,
            "warmup": spec.warmup,
            "mode": spec.mode,
            "seed": spec.seed,
            "sources": spec.sources,
            "module": spec.module,
            "import_root": spec.import_root,
            "grads_dir": spec.grads_dir,
            "compile_backend": spec.compile_backend,
            "result": str(tmpdir / "result.json"),
        }
        (tmpdir / "config.json").write_text(json.dumps(config), encoding="utf-8")
        env = dict(os.environ)
        env[CONFIG_ENV] = str(tmpdir / "config.json")
        env["PYTHONHASHSEED"] = "0"
        if spec.mode == "parity":
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        out_path = tmpdir / "output.txt"
        with out_path.open("wb") as out:
            try:
                proc = subprocess.run(
                    _command(spec.nproc),
                    cwd=spec.cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                    check=False,
                )
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                return ChildResult(
                    returncode=124,
                    result=None,
                    output_tail=f"timed out after {timeout:g} s\n" + _tail(out_path),
                )
        results = {
            r: _read(Path(rank_result_path(str(tmpdir / "result.json"), r))) for r in range(spec.nproc)
        }
        result = results.pop(0)
        if result is not None and returncode not in (0, EXIT_SCRIPT_ERROR):
            result = None  # the harness itself failed after writing: do not trust it
        others = {r: data for r, data in results.items() if data is not None}
        return ChildResult(
            returncode=returncode, result=result, output_tail=_tail(out_path), rank_results=others
        )


def _command(nproc: int) -> list[str]:
    """The harness, in one process or on `nproc` ranks through torchrun (--standalone: a rendezvous of its
    own on this machine; a failing rank stops the others, as torchrun does)."""
    harness = ["-m", "opadvisor.verify.harness"]
    if nproc <= 1:
        return [sys.executable, *harness]
    launcher = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
    ]
    return [sys.executable, *launcher, *harness]


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

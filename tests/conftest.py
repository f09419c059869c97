"""Shared test setup: GPU tests are marked `gpu` and skipped where CUDA is not available; torchvision
(which timm brings where it is installed, as .ci/run does, and which lightning and transformers' Trainer
import when it is there) imports on a CPU-only torch, in this process and in every process the tests
start (cpu_torchvision/), and only there."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

# One intra-op thread per process (xdist's workers and every process the tests start): the suite runs a worker
# per core and most tests start processes of their own, so torch's default (a thread per core) oversubscribes
# the cores and its threads spin waiting for each other (on 2 cores: ~8% more CPU idle, more under load). Set
# before torch is imported here; an explicit OMP_NUM_THREADS is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Source analysis gets 20 CPU seconds per (file, rule) in the tests and the processes they start, not the
# product's 2 (+ 1 ms a line): the tests check what the analysis finds, not how fast, and on a loaded host
# (two workers and their processes on two cores) analyses that take 0.3-0.7 s alone went past 2 s and left
# fixes unwritten (CI at e595226: dataloader_stall; a local run: fuse_region on deberta_train.py). The
# budget's own tests set theirs (tests/rewrite/test_analysis_budget.py); a hang is still caught, by the
# real-code tests' timeouts.
os.environ.setdefault("OPADVISOR_ANALYSIS_BUDGET_S", "20")

import pytest
from cli_testlib import REPO, copy_project, profile_example, profile_script
from filelock import FileLock

_CPU_TORCHVISION = Path(__file__).resolve().parent / "cpu_torchvision"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_CPU_TORCHVISION), os.environ.get("PYTHONPATH")) if p
)
# Loaded as a module of its own (kept in sys.modules): runpy.run_path would clear its globals once run, and
# the import hook it installs reads them when torchvision is first imported in this process.
_spec = importlib.util.spec_from_file_location(
    "_opadvisor_cpu_torchvision", _CPU_TORCHVISION / "sitecustomize.py"
)
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)

# transformers' optional-dependency check imports a top-level `kernels` package it finds without metadata
# (its last resort, in import_utils._is_package_available): from the checkout's root, where `python -m
# pytest` puts the working folder on sys.path, that is this repository's kernels/ folder, a second copy of
# opadvisor.kernels whose torch.library ops take over the first's (a test that patches the first copy's
# seeds then compiles against the second: order-dependent failures). Users never have the folder on their
# path (it ships as opadvisor.kernels): here the name is the package itself.
import opadvisor.kernels  # noqa: E402 - after OMP_NUM_THREADS, which must precede torch's import

sys.modules.setdefault("kernels", opadvisor.kernels)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _each_test_rewrites_afresh() -> None:
    """The engine remembers its rewrites per process (engine.forget_rewrites); a test starts without them, so
    a test that changes a codemod between two calls is not answered from another test's."""
    from opadvisor.rewrite.engine import forget_rewrites

    forget_rewrites()


@pytest.fixture(scope="session")
def made_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], None]], Path]:
    """(key, make) -> a folder `make` filled once for the whole test run, shared by every xdist worker.

    A session fixture runs once per worker: with `-n auto` the profiles and runs that several test files
    share were made once on each worker. Here the first worker to ask makes the folder (under a lock) in
    the run's common temporary folder, and the others reuse it. Users of the folder must not change it.
    """
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "made-once"
    root.mkdir(parents=True, exist_ok=True)

    def get(key: str, make: Callable[[Path], None]) -> Path:
        folder = root / key
        with FileLock(str(folder) + ".lock"):
            if not (root / f"{key}.done").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                make(folder)
                (root / f"{key}.done").touch()
        return folder

    return get


@pytest.fixture(scope="session")
def example_project(made_once) -> Callable[[str, Path], Path]:
    """(example, dest) -> dest: a private copy of a project holding examples/<example> (bert_train.py, say)
    and one run of it, profiled with cli_testlib.example_args once for the whole test run: apply and verify tests change
    their copy, never the profile they share."""

    def get(name: str, dest: Path) -> Path:
        source = made_once(
            f"example-{name.removesuffix('.py')}", lambda project: profile_example(name, project)
        )
        return copy_project(source, dest)

    return get


@pytest.fixture(scope="session")
def script_run(made_once) -> Callable[..., Path]:
    """(script, *args) -> the run folder of `opadvisor profile SCRIPT --steps 2 --warmup 1 [-- ARGS]` run
    from the checkout's root (cli_testlib.profile_script), made once a test run for every test directory
    that profiles the same script alike; what profile printed is `run.stdout.txt` and `run.stderr.txt`
    beside it."""

    def get(script: Path, *args: str) -> Path:
        parts = script.resolve().relative_to(REPO).with_suffix("").parts
        key = "-".join(["script", *parts, *(a.strip("-") for a in args)])
        return made_once(key, lambda folder: profile_script(script, folder / "run", *args)) / "run"

    return get

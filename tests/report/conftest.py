"""Fixtures of the report and diff tests (helpers in report_testlib.py)."""

from __future__ import annotations

import pytest
from report_testlib import ExampleRuns, make_example_runs


@pytest.fixture(scope="session")
def example_runs(made_once, example_project) -> ExampleRuns:
    """examples/bert_train.py profiled on the CPU, fused_softmax applied, profiled again (once a test run)."""
    project = (
        made_once("report-example", lambda folder: make_example_runs(folder, example_project)) / "project"
    )
    return ExampleRuns(project, project / "before", project / "after")

"""Fixtures of the report and diff tests (helpers in report_testlib.py)."""

from __future__ import annotations

import pytest
from report_testlib import ExampleRuns, make_example_runs


@pytest.fixture(scope="session")
def example_runs(tmp_path_factory) -> ExampleRuns:
    """examples/bert_train.py profiled on the CPU, fused_softmax applied, profiled again (once a session)."""
    return make_example_runs(tmp_path_factory.mktemp("example"))

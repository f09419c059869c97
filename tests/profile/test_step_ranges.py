"""Step ranges are read from the event tree without touching Python events' names (torch 2.13 sometimes
gives one bytes that are not UTF-8, and reading it raised UnicodeDecodeError: a profile failed at random)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opadvisor.profile.events import profiler_step_ranges


class _ExtraFields_TorchOp:  # noqa: N801 - named as torch names it: the tag is read from the class name
    pass


class _ExtraFields_PyCall:  # noqa: N801
    pass


@dataclass
class FakeEvent:
    tag: type
    raw_name: str | bytes
    start_time_ns: int = 0
    duration_time_ns: int = 0
    children: list = field(default_factory=list)

    @property
    def extra_fields(self):
        return self.tag()

    @property
    def name(self) -> str:
        if isinstance(self.raw_name, bytes):
            return self.raw_name.decode("utf-8")  # raises, as torch's binding does
        return self.raw_name


def test_step_ranges_skip_python_events_names() -> None:
    garbage = FakeEvent(_ExtraFields_PyCall, b"torch/profiler/_cupti_monitor.py(0): \xe0\xbb\x05")
    step0 = FakeEvent(_ExtraFields_TorchOp, "ProfilerStep#0", 100, 50, [garbage])
    step1 = FakeEvent(_ExtraFields_TorchOp, "ProfilerStep#1", 150, 40)
    other = FakeEvent(_ExtraFields_TorchOp, "aten::add", 120, 5)
    assert profiler_step_ranges([step0, other, step1]) == {0: (100, 150), 1: (150, 190)}

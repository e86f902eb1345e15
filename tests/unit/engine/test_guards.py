"""The drift guards as state machines (E-19, E-20, E-21)."""

from __future__ import annotations

from app.engine.guards import CompletionChecklist, CycleDetector, ReflectionSchedule, call_fingerprint


def test_fingerprint_ignores_key_order_but_not_values() -> None:
    assert call_fingerprint("t", {"a": 1, "b": [1, 2]}) == call_fingerprint("t", {"b": [1, 2], "a": 1})
    assert call_fingerprint("t", {"a": 1}) != call_fingerprint("t", {"a": 2})
    assert call_fingerprint("t", {"a": 1}) != call_fingerprint("u", {"a": 1})


def test_cycle_detector_warns_from_the_threshold_on_with_the_count() -> None:
    detector = CycleDetector(3)

    warnings = [detector.record("search", {"q": "x"}) for _ in range(4)]

    assert warnings[:2] == [None, None]
    assert warnings[2] == (
        "You have called `search` with identical arguments 3 times and received the same result. "
        "Please try a different approach or tool."
    )
    assert warnings[3] is not None and "4 times" in warnings[3]


def test_cycle_detector_counts_each_call_separately() -> None:
    detector = CycleDetector(2)

    assert detector.record("a", {}) is None
    assert detector.record("b", {}) is None
    assert detector.record("a", {"x": 1}) is None
    assert detector.record("a", {}) is not None


def test_reflection_is_due_when_a_multiple_of_the_interval_is_crossed() -> None:
    schedule = ReflectionSchedule(6)

    due = [schedule.record(1) for _ in range(12)]

    assert [i + 1 for i, d in enumerate(due) if d] == [6, 12]


def test_reflection_fires_once_for_a_batch_crossing_the_boundary() -> None:
    schedule = ReflectionSchedule(6)

    assert schedule.record(5) is False
    assert schedule.record(3) is True
    assert schedule.tool_calls == 8
    assert schedule.record(3) is False
    assert schedule.record(1) is True


def test_checklist_fires_once_and_only_with_enough_tools() -> None:
    checklist = CompletionChecklist(enabled=True, min_tools=3)

    assert checklist.should_fire(2) is False
    assert checklist.should_fire(3) is True
    assert checklist.should_fire(5) is False


def test_checklist_disabled_never_fires_and_zero_tools_never_fire() -> None:
    assert CompletionChecklist(enabled=False, min_tools=1).should_fire(10) is False
    assert CompletionChecklist(enabled=True, min_tools=0).should_fire(0) is False

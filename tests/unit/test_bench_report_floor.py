"""bench/report_capacity.py's rows against the floor: the guarded floor's own, when it ran."""

from __future__ import annotations

from bench.report_capacity import capacity_targets

GUARDED_ROW = "knee: the guarded floor"


def _level(users: int, ok: bool) -> dict:
    return {"users": users, "ok": ok, "p99_ms": 10.0 if ok else 80.0}


def _knee(*, guarded: bool) -> dict:
    subjects = [
        {"key": "floor", "subject": "floor", "knee": 360, "levels": [_level(360, True), _level(420, False)]},
        {"key": "one", "subject": "one", "knee": 140, "levels": [_level(140, True), _level(160, False)]},
    ]
    compared = {"one": {"knee": 140, "floor_knee": 360, "knee_ratio": 140 / 360, "cpu_per_token": {}}}
    if guarded:
        subjects.append(
            {
                "key": "guarded",
                "subject": "guarded",
                "knee": 300,
                "levels": [_level(300, True), _level(360, False)],
            }
        )
        compared["guarded"] = {
            "knee": 300,
            "floor_knee": 360,
            "knee_ratio": 300 / 360,
            "cpu_per_token": {"users": 300, "cpu_per_token_ratio": 1.144},
        }
    return {"subjects": subjects, "floor": compared}


def test_the_guarded_floor_is_reported_against_the_floor_without_a_verdict() -> None:
    row = next(r for r in capacity_targets(_knee(guarded=True), None, None) if r[1].startswith(GUARDED_ROW))

    assert row[2] == "0.83x (300 runs (first missed level: 360)); 1.14x at 300 users"
    assert row[3] is None  # what keeping the guarantees costs at the least: reported, not a target


def test_no_guarded_row_when_it_did_not_run() -> None:
    rows = capacity_targets(_knee(guarded=False), None, None)

    assert not [r for r in rows if r[1].startswith(GUARDED_ROW)]
    assert any(r[1].startswith("knee: one worker (SQLite)") for r in rows)

"""Tool arguments a model sends that no JSON parser should choke on become argument errors (E-27)."""

from __future__ import annotations

import pytest

from app.engine.tool_results import decode_args


@pytest.mark.parametrize(
    "raw",
    ["[" * 10_000 + "]" * 10_000, '{"a": ' + "[" * 10_000 + "]" * 10_000 + "}", '{"n": 1' + "0" * 5000 + "}"],
    ids=["deep-array", "deep-value", "huge-integer"],
)
def test_arguments_nested_too_deeply_or_too_large_are_an_error_not_a_crash(raw: str) -> None:
    args, error = decode_args("calculator", raw)

    assert args == {}
    assert error is not None and error.startswith("Invalid arguments for tool 'calculator'")

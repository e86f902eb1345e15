"""Hostile input to the built-in tools and the registry: refused in bounded time, or made safe.

Complements ``test_calculator.py`` and ``test_builtins.py`` with towers of powers, expansions that
grow by multiplication, non-finite numbers, and tool output no event or database can carry.
"""

from __future__ import annotations

import math
import time

import pytest

from app.tools.builtins import default_registry
from app.tools.calculator import CalculatorError, evaluate
from app.tools.registry import Artifact, Tool, ToolOutput, ToolRegistry


@pytest.mark.parametrize(
    "expression",
    [
        "9**9**9**9",
        "10**10000000",
        "2**2**2**2**2**2",
        "((10**10)**10)**10",
        "(10**150)**3",
        "1" + "*99999999" * 50,
        "9**300*9**300",
        "1.0000001**(10**20)",
        "2**-(10**400)",
        "0.5**-2000",
        "(-2.0)**1025",
        "10**300//1e-300",
        "max(" + ",".join(["9**300"] * 49) + ")*9**300",
    ],
)
def test_towers_and_expansions_are_refused_at_once(expression: str) -> None:
    started = time.perf_counter()

    with pytest.raises(CalculatorError, match="too large"):
        evaluate(expression)

    assert time.perf_counter() - started < 0.05


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("(-1)**(10**100)", 1),
        ("0**(10**100)", 0),
        ("2**-(10**100)", 0.0),
        ("(1+1e-16)**1e300", 1.0),
        ("round(10**300, -10**300)", 10**300),
        ("(" * 200 + "1" + ")" * 200, 1),
    ],
)
def test_huge_exponents_with_small_results_are_computed_quickly(expression: str, expected: float) -> None:
    started = time.perf_counter()

    assert evaluate(expression) == expected
    assert time.perf_counter() - started < 0.05


@pytest.mark.parametrize("expression", ["(" * 10_000 + "1" + ")" * 10_000, "1+" * 100_000 + "1", "9" * 10**6])
def test_huge_expressions_are_refused_before_parsing(expression: str) -> None:
    started = time.perf_counter()

    with pytest.raises(CalculatorError, match="longer than"):
        evaluate(expression)

    assert time.perf_counter() - started < 0.05


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_unit_convert_refuses_values_that_are_not_finite(value: float) -> None:
    result = await default_registry().execute(
        "unit_convert", {"value": value, "from_unit": "m", "to_unit": "ft"}
    )

    assert result.error is not None and "out of range" in result.error


async def test_word_count_of_pathological_text_is_linear() -> None:
    started = time.perf_counter()

    result = await default_registry().execute("word_count", {"text": "a'" * 99_000 + "!"})

    assert result.ok and result.content.startswith("words: 1,")
    assert time.perf_counter() - started < 1.0


def careless(output: str | ToolOutput, *, fails: bool = False) -> Tool:
    async def run() -> str | ToolOutput:
        if fails:
            raise RuntimeError(output)
        return output

    return Tool("careless", "returns what it was given", {"type": "object", "properties": {}}, run)


@pytest.mark.parametrize(
    ("tool", "field"),
    [
        (careless("a\x00b\ud800c"), "content"),
        (careless("a\x00b\ud800c", fails=True), "error"),
    ],
)
async def test_nul_and_lone_surrogates_from_a_tool_become_replacement_characters(
    tool: Tool, field: str
) -> None:
    result = await ToolRegistry.of([tool]).execute("careless", {})

    text = getattr(result, field)
    assert "\x00" not in text and "\ud800" not in text
    assert "a\ufffdb\ufffdc" in text
    text.encode()  # valid UTF-8 now


async def test_a_tool_artifact_is_cleaned_like_its_content() -> None:
    output = ToolOutput("ok\x00", Artifact("re\ud800port.md", "text/markdown", "# t\x00\n"))

    result = await ToolRegistry.of([careless(output)]).execute("careless", {})

    assert result.content == "ok\ufffd"
    assert result.artifact == Artifact("re\ufffdport.md", "text/markdown", "# t\ufffd\n")

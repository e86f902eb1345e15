"""The built-in tools, called through the registry the engine uses."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from app.tools.builtins import MAX_NOTES, convert_units, default_registry, slugify
from app.tools.registry import ToolInvocation, ToolRegistry

FIXED_NOW = datetime(2026, 1, 15, 12, 30, 0, tzinfo=UTC)


@pytest.fixture
def registry() -> ToolRegistry:
    return default_registry(clock=lambda: FIXED_NOW)


def test_registry_has_every_builtin_with_an_object_schema(registry: ToolRegistry) -> None:
    assert set(registry.names()) >= {
        "calculator",
        "current_time",
        "write_report",
        "unit_convert",
        "word_count",
        "save_note",
        "list_notes",
    }
    for tool in registry:
        assert tool.parameters["type"] == "object"
        assert tool.description.strip()
        assert len(tool.one_line()) <= 80
        assert 0 < tool.timeout_s <= 30


def test_only_save_note_is_marked_as_writing(registry: ToolRegistry) -> None:
    assert [tool.name for tool in registry if tool.writes] == ["save_note"]


async def test_calculator_answers_with_expression_and_result(registry: ToolRegistry) -> None:
    result = await registry.execute("calculator", {"expression": "17*23"})

    assert result.ok
    assert result.content == "17*23 = 391"


async def test_calculator_errors_become_tool_errors(registry: ToolRegistry) -> None:
    result = await registry.execute("calculator", {"expression": "__import__('os')"})

    assert not result.ok
    assert result.error is not None and "not allowed" in result.error


async def test_calculator_rejects_a_non_string_expression(registry: ToolRegistry) -> None:
    result = await registry.execute("calculator", {"expression": 5})

    assert result.error is not None and "must be a string" in result.error


async def test_current_time_in_tokyo(registry: ToolRegistry) -> None:
    result = await registry.execute("current_time", {"timezone": "Asia/Tokyo"})

    assert result.ok
    assert result.content.startswith("2026-01-15 21:30:00 JST (UTC+09:00), Thursday")
    assert "Asia/Tokyo" in result.content


async def test_current_time_defaults_to_utc(registry: ToolRegistry) -> None:
    result = await registry.execute("current_time", {})

    assert result.content.startswith("2026-01-15 12:30:00 UTC (UTC+00:00)")


@pytest.mark.parametrize("zone", ["Mars/Olympus", "../../etc/passwd", "", "Asia/Tokyo; rm -rf /"])
async def test_current_time_refuses_unknown_or_hostile_zone_names(registry: ToolRegistry, zone: str) -> None:
    result = await registry.execute("current_time", {"timezone": zone})

    assert not result.ok


async def test_current_time_uses_the_real_clock_by_default() -> None:
    before = datetime.now(UTC).replace(microsecond=0)

    result = await default_registry().execute("current_time", {"timezone": "UTC"})

    stamp = datetime.strptime(result.content[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
    assert before <= stamp <= datetime.now(UTC)


@pytest.mark.parametrize(
    ("value", "source", "target", "expected"),
    [
        (5, "km", "mi", 3.10686),
        (1, "mile", "feet", 5280),
        (12, "inches", "cm", 30.48),
        (2, "kg", "lb", 4.40925),
        (16, "oz", "pounds", 1.0),
        (100, "celsius", "fahrenheit", 212),
        (32, "F", "C", 0),
        (0, "kelvin", "celsius", -273.15),
    ],
)
def test_convert_units(value: float, source: str, target: str, expected: float) -> None:
    assert convert_units(value, source, target) == pytest.approx(expected, rel=1e-5)


async def test_unit_convert_tool_formats_the_result(registry: ToolRegistry) -> None:
    result = await registry.execute("unit_convert", {"value": 5, "from_unit": "km", "to_unit": "mi"})

    assert result.content == "5 km = 3.10686 mi"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"value": 1, "from_unit": "km", "to_unit": "kg"}, "different things"),
        ({"value": 1, "from_unit": "parsec", "to_unit": "m"}, "unknown unit 'parsec'"),
        ({"value": -500, "from_unit": "c", "to_unit": "k"}, "below absolute zero"),
        ({"value": "ten", "from_unit": "m", "to_unit": "ft"}, "must be a number"),
        ({"value": 1e300, "from_unit": "m", "to_unit": "ft"}, "out of range"),
    ],
)
async def test_unit_convert_refuses_bad_input(
    registry: ToolRegistry, args: dict[str, object], message: str
) -> None:
    result = await registry.execute("unit_convert", args)

    assert result.error is not None and message in result.error


async def test_word_count_reports_text_statistics(registry: ToolRegistry) -> None:
    text = "The cat sat. The dog didn't!\nA well-known fact?"

    result = await registry.execute("word_count", {"text": text})

    assert result.content.startswith("words: 9, unique words: 8, characters: 47")
    assert "sentences: 3, lines: 2" in result.content


async def test_word_count_of_empty_text_is_zero(registry: ToolRegistry) -> None:
    result = await registry.execute("word_count", {"text": ""})

    assert result.content.startswith("words: 0")


async def test_word_count_refuses_huge_text(registry: ToolRegistry) -> None:
    result = await registry.execute("word_count", {"text": "a " * 200_000})

    assert result.error is not None and "longer than" in result.error


async def test_write_report_makes_a_markdown_artifact(registry: ToolRegistry) -> None:
    result = await registry.execute("write_report", {"title": "Q3 Sales: Überblick!", "content": "- up 10%"})

    assert result.ok
    assert result.artifact is not None
    assert result.artifact.filename == "q3-sales-uberblick.md"
    assert result.artifact.mime_type == "text/markdown"
    assert result.artifact.content == "# Q3 Sales: Überblick!\n\n- up 10%\n"
    assert "q3-sales-uberblick.md" in result.content


async def test_write_report_keeps_a_heading_the_content_already_has(registry: ToolRegistry) -> None:
    result = await registry.execute("write_report", {"title": "T", "content": "# Own heading\n\nbody"})

    assert result.artifact is not None and result.artifact.content == "# Own heading\n\nbody\n"


async def test_write_report_needs_a_title(registry: ToolRegistry) -> None:
    result = await registry.execute("write_report", {"title": "  ", "content": "x"})

    assert result.error is not None and "'title' must not be empty" in result.error


@pytest.mark.parametrize(
    ("title", "slug"), [("Hello, World", "hello-world"), ("!!!", "report"), ("../x", "x")]
)
def test_slugify_makes_safe_file_names(title: str, slug: str) -> None:
    assert slugify(title) == slug


async def test_notes_are_saved_listed_and_replaced_by_title(registry: ToolRegistry) -> None:
    assert (await registry.execute("list_notes", {})).content == "There are no notes yet."

    await registry.execute("save_note", {"title": "milk", "content": "buy 2 litres"})
    await registry.execute("save_note", {"title": "call", "content": "call Ana"})
    replaced = await registry.execute("save_note", {"title": "milk", "content": "buy 3 litres"})
    listed = await registry.execute("list_notes", {})

    assert replaced.content.startswith("Updated the note 'milk'")
    assert listed.content == "2 note(s):\n- milk: buy 3 litres\n- call: call Ana"


async def test_each_registry_has_its_own_notebook(registry: ToolRegistry) -> None:
    await registry.execute("save_note", {"title": "a", "content": "b"})

    other = default_registry()

    assert (await other.execute("list_notes", {})).content == "There are no notes yet."


async def test_the_notebook_is_bounded(registry: ToolRegistry) -> None:
    for i in range(MAX_NOTES):
        assert (await registry.execute("save_note", {"title": f"n{i}", "content": "x"})).ok

    result = await registry.execute("save_note", {"title": "one more", "content": "x"})

    assert result.error is not None and "full" in result.error


async def test_unknown_arguments_become_tool_errors(registry: ToolRegistry) -> None:
    result = await registry.execute("calculator", {"expr": "1+1"})

    assert result.error is not None and "Invalid arguments" in result.error


def test_every_builtin_may_be_run_again_after_a_crash(registry: ToolRegistry) -> None:
    # They only read or compute; save_note writes under the call's idempotency key.
    assert [tool.name for tool in registry if not tool.idempotent] == []
    assert {tool.name for tool in registry if tool.takes_invocation} == {"save_note", "list_notes"}


async def test_notes_belong_to_their_owner_and_a_repeated_call_stores_nothing_twice(
    registry: ToolRegistry,
) -> None:
    alice = ToolInvocation(idempotency_key="run_1:call_1", owner="alice")
    first = await registry.execute("save_note", {"title": "milk", "content": "2 litres"}, invocation=alice)
    again = await registry.execute("save_note", {"title": "milk", "content": "2 litres"}, invocation=alice)
    bob = ToolInvocation(idempotency_key="run_2:call_1", owner="bob")

    assert first.content == again.content == "Saved the note 'milk' (1 notes in total)."
    assert (await registry.execute("list_notes", {}, invocation=bob)).content == "There are no notes yet."
    listed = await registry.execute("list_notes", {}, invocation=ToolInvocation("k", owner="alice"))
    assert listed.content == "1 note(s):\n- milk: 2 litres"

"""The built-in tools every agent gets, assembled by ``default_registry()``.

``calculator`` (safe arithmetic), ``current_time`` (IANA time zones), ``unit_convert`` (length, mass,
temperature), ``word_count`` (text statistics), ``write_report`` (a markdown artifact), and
``save_note`` / ``list_notes`` (a notebook per owner, in the service's database). Each tool checks its
input and raises ``ToolInputError`` with a message the model can act on; none does unbounded work.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from app.tools.calculator import MAX_EXPRESSION_CHARS, evaluate, format_number
from app.tools.registry import Artifact, Tool, ToolInvocation, ToolOutput, ToolRegistry

MAX_TEXT_CHARS = 200_000
MAX_TITLE_CHARS = 200
MAX_NOTES = 200
MAX_NOTE_CHARS = 10_000
Clock = Callable[[], datetime]


class ToolInputError(ValueError):
    """A tool was called with arguments it cannot use; the message says what is expected."""


class NotebookFull(Exception):
    """A store's refusal of a new note past the limit (the service's ``NoteRepo`` raises its own
    subclass); the tool reports it to the model."""


def _text_arg(name: str, value: object, *, max_chars: int, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ToolInputError(f"'{name}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ToolInputError(f"'{name}' must not be empty")
    if len(value) > max_chars:
        raise ToolInputError(f"'{name}' is longer than {max_chars} characters")
    return value


# -- calculator --------------------------------------------------------------------------------


async def calculator(expression: str) -> str:
    expression = _text_arg("expression", expression, max_chars=MAX_EXPRESSION_CHARS)
    return f"{expression.strip()} = {format_number(evaluate(expression))}"


CALCULATOR_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "Arithmetic expression, e.g. '17*23' or 'sqrt(2)*pi'.",
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}


# -- current_time ------------------------------------------------------------------------------


def _zone(name: str) -> ZoneInfo:
    cleaned = name.strip().replace(" ", "_")
    if cleaned.upper() in ("UTC", "GMT", "Z"):
        cleaned = "UTC"
    if not re.fullmatch(r"[A-Za-z0-9_+\-/]{1,64}", cleaned) or ".." in cleaned:
        raise ToolInputError(f"'{name}' is not an IANA time zone name such as 'Europe/Paris'")
    try:
        return ZoneInfo(cleaned)
    except (ZoneInfoNotFoundError, ValueError):
        raise ToolInputError(f"unknown time zone '{name}'; use an IANA name such as 'Asia/Tokyo'") from None


def make_current_time(clock: Clock) -> Callable[..., Any]:
    async def current_time(timezone: str = "UTC") -> str:
        timezone = _text_arg("timezone", timezone, max_chars=64)
        zone = _zone(timezone)
        now = clock().astimezone(zone)
        offset = now.strftime("%z")
        return (
            f"{now:%Y-%m-%d %H:%M:%S} {now.tzname()} (UTC{offset[:3]}:{offset[3:]}), {now:%A}, in {zone.key}"
        )

    return current_time


CURRENT_TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "timezone": {
            "type": "string",
            "description": "IANA time zone name such as 'Asia/Tokyo'; defaults to UTC.",
        }
    },
    "additionalProperties": False,
}


# -- unit_convert ------------------------------------------------------------------------------

# Factors to the base unit of each dimension (metre, kilogram).
_LENGTH = {
    "mm": 0.001,
    "cm": 0.01,
    "m": 1.0,
    "km": 1000.0,
    "in": 0.0254,
    "ft": 0.3048,
    "yd": 0.9144,
    "mi": 1609.344,
    "nmi": 1852.0,
}
_MASS = {
    "mg": 1e-6,
    "g": 0.001,
    "kg": 1.0,
    "t": 1000.0,
    "oz": 0.028349523125,
    "lb": 0.45359237,
    "st": 6.35029318,
}
_TEMPERATURE = ("c", "f", "k")
_ALIASES = {
    "millimeter": "mm",
    "millimetre": "mm",
    "centimeter": "cm",
    "centimetre": "cm",
    "meter": "m",
    "metre": "m",
    "kilometer": "km",
    "kilometre": "km",
    "inch": "in",
    "inches": "in",
    "foot": "ft",
    "feet": "ft",
    "yard": "yd",
    "mile": "mi",
    "nautical mile": "nmi",
    "milligram": "mg",
    "gram": "g",
    "kilogram": "kg",
    "kilo": "kg",
    "tonne": "t",
    "ton": "t",
    "ounce": "oz",
    "pound": "lb",
    "lbs": "lb",
    "stone": "st",
    "celsius": "c",
    "°c": "c",
    "centigrade": "c",
    "fahrenheit": "f",
    "°f": "f",
    "kelvin": "k",
}


def _unit(name: object, label: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ToolInputError(f"'{label}' must be a unit name such as 'km', 'lb' or 'celsius'")
    key = name.strip().lower().rstrip(".").removeprefix("degrees ").removeprefix("degree ")
    for candidate in (key, key.removesuffix("s"), key.removesuffix("es")):
        if candidate in _LENGTH or candidate in _MASS or candidate in _TEMPERATURE:
            return candidate
        if candidate in _ALIASES:
            return _ALIASES[candidate]
    known = ", ".join([*_LENGTH, *_MASS, "celsius", "fahrenheit", "kelvin"])
    raise ToolInputError(f"unknown unit '{name}'; known units: {known}")


def _to_kelvin(value: float, unit: str) -> float:
    if unit == "c":
        return value + 273.15
    if unit == "f":
        return (value - 32.0) * 5.0 / 9.0 + 273.15
    return value


def _from_kelvin(value: float, unit: str) -> float:
    if unit == "c":
        return value - 273.15
    if unit == "f":
        return (value - 273.15) * 9.0 / 5.0 + 32.0
    return value


def convert_units(value: float, from_unit: str, to_unit: str) -> float:
    """``value`` in ``from_unit`` expressed in ``to_unit`` (same dimension only)."""
    source, target = _unit(from_unit, "from_unit"), _unit(to_unit, "to_unit")
    for table in (_LENGTH, _MASS):
        if source in table and target in table:
            return value * table[source] / table[target]
    if source in _TEMPERATURE and target in _TEMPERATURE:
        kelvin = _to_kelvin(value, source)
        if kelvin < 0:
            raise ToolInputError("that temperature is below absolute zero")
        return _from_kelvin(kelvin, target)
    raise ToolInputError(f"cannot convert {from_unit} to {to_unit}: they measure different things")


async def unit_convert(value: float, from_unit: str, to_unit: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolInputError(f"'value' must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > 1e15:  # NaN and infinities come from lenient JSON
        raise ToolInputError("'value' is out of range (a finite number, at most 1e15)")
    result = convert_units(float(value), from_unit, to_unit)
    return f"{format_number(float(value))} {from_unit.strip()} = {format(result, '.6g')} {to_unit.strip()}"


UNIT_CONVERT_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "value": {"type": "number", "description": "The quantity to convert."},
        "from_unit": {"type": "string", "description": "Unit of the value, e.g. 'km', 'lb', 'celsius'."},
        "to_unit": {
            "type": "string",
            "description": "Unit wanted, of the same kind (length, mass, temperature).",
        },
    },
    "required": ["value", "from_unit", "to_unit"],
    "additionalProperties": False,
}


# -- word_count --------------------------------------------------------------------------------

_WORD_RE = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")
_SENTENCE_END_RE = re.compile(r"[.!?。！？]+(?=\s|$)")


async def word_count(text: str) -> str:
    text = _text_arg("text", text, max_chars=MAX_TEXT_CHARS, allow_empty=True)
    words = _WORD_RE.findall(text)
    sentences = len(_SENTENCE_END_RE.findall(text)) or (1 if words else 0)
    lines = text.count("\n") + 1 if text else 0
    unique = len({w.lower() for w in words})
    return (
        f"words: {len(words)}, unique words: {unique}, characters: {len(text)}, "
        f"characters without spaces: {sum(1 for ch in text if not ch.isspace())}, "
        f"sentences: {sentences}, lines: {lines}"
    )


WORD_COUNT_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string", "description": "The text to measure."}},
    "required": ["text"],
    "additionalProperties": False,
}


# -- write_report ------------------------------------------------------------------------------


def slugify(title: str, *, max_len: int = 60) -> str:
    """``"Q3 Sales: Überblick!"`` -> ``"q3-sales-uberblick"``; never empty, safe as a file name."""
    ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")
    return slug[:max_len].rstrip("-") or "report"


async def write_report(title: str, content: str) -> ToolOutput:
    title = _text_arg("title", title, max_chars=MAX_TITLE_CHARS).strip()
    content = _text_arg("content", content, max_chars=MAX_TEXT_CHARS)
    body = content.strip()
    markdown = body if body.startswith("# ") else f"# {title}\n\n{body}"
    filename = f"{slugify(title)}.md"
    words = len(_WORD_RE.findall(body))
    return ToolOutput(
        content=f"Wrote the report '{title}' to {filename} ({words} words).",
        artifact=Artifact(filename=filename, mime_type="text/markdown", content=markdown + "\n"),
    )


WRITE_REPORT_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "description": "Report title (also names the file)."},
        "content": {"type": "string", "description": "The report body in markdown."},
    },
    "required": ["title", "content"],
    "additionalProperties": False,
}


# -- notes -------------------------------------------------------------------------------------


class NoteStore(Protocol):
    """Where the notebook keeps its notes: the database in the service (``NoteRepo``)."""

    async def save(
        self,
        owner: str,
        title: str,
        content: str,
        *,
        idempotency_key: str,
        max_notes: int,
        describe: Callable[[bool, int], str],
    ) -> str: ...

    async def notes(self, owner: str) -> list[tuple[str, str]]: ...


class MemoryNoteStore:
    """A ``NoteStore`` in memory, for an engine without a database (tests, scripts)."""

    def __init__(self) -> None:
        self._notes: dict[str, dict[str, str]] = {}
        self._effects: dict[str, str] = {}

    async def save(
        self,
        owner: str,
        title: str,
        content: str,
        *,
        idempotency_key: str,
        max_notes: int,
        describe: Callable[[bool, int], str],
    ) -> str:
        if idempotency_key and idempotency_key in self._effects:
            return self._effects[idempotency_key]
        notes = self._notes.setdefault(owner, {})
        replaced = title in notes
        if not replaced and len(notes) >= max_notes:
            raise ToolInputError(f"the notebook is full ({max_notes} notes)")
        notes[title] = content
        result = describe(replaced, len(notes))
        if idempotency_key:
            self._effects[idempotency_key] = result
        return result

    async def notes(self, owner: str) -> list[tuple[str, str]]:
        return list(self._notes.get(owner, {}).items())


@dataclass(slots=True)
class Notebook:
    """The notes of each owner, by title; bounded in count and size. A call repeated under its
    idempotency key (a run carried on after a crash) stores nothing twice (RUNS.md R-12)."""

    store: NoteStore = field(default_factory=MemoryNoteStore)

    async def save_note(self, title: str, content: str, invocation: ToolInvocation) -> str:
        title = _text_arg("title", title, max_chars=MAX_TITLE_CHARS).strip()
        content = _text_arg("content", content, max_chars=MAX_NOTE_CHARS)

        def describe(replaced: bool, total: int) -> str:
            return f"{'Updated' if replaced else 'Saved'} the note '{title}' ({total} notes in total)."

        try:
            return await self.store.save(
                invocation.owner,
                title,
                content,
                idempotency_key=invocation.idempotency_key,
                max_notes=MAX_NOTES,
                describe=describe,
            )
        except NotebookFull as exc:
            raise ToolInputError(str(exc)) from exc

    async def list_notes(self, invocation: ToolInvocation) -> str:
        notes = await self.store.notes(invocation.owner)
        if not notes:
            return "There are no notes yet."
        lines = [f"- {title}: {content}" for title, content in notes]
        return f"{len(notes)} note(s):\n" + "\n".join(lines)


SAVE_NOTE_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {
            "type": "string",
            "description": "Short title; saving under an existing title replaces it.",
        },
        "content": {"type": "string", "description": "The note text."},
    },
    "required": ["title", "content"],
    "additionalProperties": False,
}
LIST_NOTES_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def builtin_tools(*, clock: Clock | None = None, notes: NoteStore | None = None) -> list[Tool]:
    """Fresh instances of every built-in tool; ``clock`` (aware datetimes) is for tests; ``notes``
    keeps the notebook (in memory when not given)."""
    book = Notebook(notes) if notes is not None else Notebook()
    now = clock or (lambda: datetime.now(UTC))
    return [
        Tool(
            "calculator",
            "Evaluate an arithmetic expression exactly (+ - * / // % **, sqrt, sin, cos, log, pi, e...).",
            CALCULATOR_PARAMETERS,
            calculator,
            timeout_s=5.0,
            idempotent=True,
        ),
        Tool(
            "current_time",
            "Current date and time in a time zone (IANA name like 'Asia/Tokyo'; default UTC).",
            CURRENT_TIME_PARAMETERS,
            make_current_time(now),
            timeout_s=5.0,
            idempotent=True,
        ),
        Tool(
            "unit_convert",
            "Convert a quantity between units of length, mass or temperature.",
            UNIT_CONVERT_PARAMETERS,
            unit_convert,
            timeout_s=5.0,
            idempotent=True,
        ),
        Tool(
            "word_count",
            "Count words, unique words, characters, sentences and lines of a text.",
            WORD_COUNT_PARAMETERS,
            word_count,
            timeout_s=5.0,
            idempotent=True,
        ),
        Tool(
            "write_report",
            "Write a markdown report file (title and markdown content) that the user can preview.",
            WRITE_REPORT_PARAMETERS,
            write_report,
            timeout_s=5.0,
            idempotent=True,  # the report is the call's result; nothing is kept elsewhere
        ),
        Tool(
            "save_note",
            "Save a short note under a title for later in this session.",
            SAVE_NOTE_PARAMETERS,
            book.save_note,
            writes=True,
            timeout_s=5.0,
            # It writes, but under the call's idempotency key: a repeat stores nothing twice.
            idempotent=True,
            takes_invocation=True,
        ),
        Tool(
            "list_notes",
            "List the notes saved so far.",
            LIST_NOTES_PARAMETERS,
            book.list_notes,
            timeout_s=5.0,
            idempotent=True,
            takes_invocation=True,
        ),
    ]


def default_registry(*, clock: Clock | None = None, notes: NoteStore | None = None) -> ToolRegistry:
    """A new registry with every built-in tool; its notebook keeps its notes in ``notes`` (the
    service's database), or in memory of its own."""
    return ToolRegistry.of(builtin_tools(clock=clock, notes=notes))

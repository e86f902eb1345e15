"""The demo model's planner: which built-in tool calls answer a question, read from its text.

``plan()`` splits a question into its sub-questions ("What is 17*23 and what time is it in Tokyo?")
and gives each the call that answers it: arithmetic (``math_expression()`` finds the expression),
times in cities, unit conversions, word counts, reports and notes. ``DemoLLM`` (``app.llm.demo``)
asks for these calls and answers from their results.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_PLANNED_CALLS = 8
MAX_PLAN_CHARS = 4000
MAX_CLAUSE_CHARS = 500

CITY_ZONES = {
    "tokyo": "Asia/Tokyo",
    "osaka": "Asia/Tokyo",
    "seoul": "Asia/Seoul",
    "beijing": "Asia/Shanghai",
    "shanghai": "Asia/Shanghai",
    "hong kong": "Asia/Hong_Kong",
    "singapore": "Asia/Singapore",
    "bangkok": "Asia/Bangkok",
    "mumbai": "Asia/Kolkata",
    "delhi": "Asia/Kolkata",
    "new delhi": "Asia/Kolkata",
    "dubai": "Asia/Dubai",
    "moscow": "Europe/Moscow",
    "istanbul": "Europe/Istanbul",
    "cairo": "Africa/Cairo",
    "berlin": "Europe/Berlin",
    "paris": "Europe/Paris",
    "madrid": "Europe/Madrid",
    "rome": "Europe/Rome",
    "amsterdam": "Europe/Amsterdam",
    "london": "Europe/London",
    "lisbon": "Europe/Lisbon",
    "new york": "America/New_York",
    "nyc": "America/New_York",
    "toronto": "America/Toronto",
    "chicago": "America/Chicago",
    "denver": "America/Denver",
    "los angeles": "America/Los_Angeles",
    "san francisco": "America/Los_Angeles",
    "seattle": "America/Los_Angeles",
    "mexico city": "America/Mexico_City",
    "sao paulo": "America/Sao_Paulo",
    "são paulo": "America/Sao_Paulo",
    "sydney": "Australia/Sydney",
    "auckland": "Pacific/Auckland",
    "utc": "UTC",
}
UNITS = {
    "mm", "cm", "m", "km", "in", "inch", "inches", "ft", "foot", "feet", "yd", "yard", "yards", "mi",
    "mile", "miles", "meter", "meters", "metre", "metres", "kilometer", "kilometers", "kilometres",
    "mg", "g", "gram", "grams", "kg", "kilogram", "kilograms", "lb", "lbs", "pound", "pounds", "oz",
    "ounce", "ounces", "c", "f", "k", "celsius", "fahrenheit", "kelvin", "°c", "°f",
}  # fmt: skip

_MATH_TOKEN_RE = re.compile(
    r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?|\*\*|//|[-+*/%^()×÷,]"
    r"|(?:sqrt|sin|cos|tan|log10|log|exp|abs|round|min|max|pi)\b)",
    re.IGNORECASE,
)
_OPERATORS = frozenset({"+", "-", "*", "/", "**", "//", "%", "^", "×", "÷"})
_WORD_OPS = [
    (r"\bsquare root of\s+(\d+(?:\.\d+)?)", r"sqrt(\1)"),
    (r"(\d+(?:\.\d+)?)\s*%\s*of\s+(\d+(?:\.\d+)?)", r"(\1/100*\2)"),
    (r"(\d)\s*squared\b", r"\1**2"),
    (r"(\d)\s*cubed\b", r"\1**3"),
    (r"\bto the power of\b|\braised to\b", "**"),
    (r"\bmultiplied by\b|\btimes\b", "*"),
    (r"\bdivided by\b|\bover\b", "/"),
    (r"\bplus\b", "+"),
    (r"\bminus\b", "-"),
    (r"\bmod(?:ulo)?\b", "%"),
    (r"(?<=\d)\s*x\s*(?=\d)", "*"),
]
_CONVERT_RE = re.compile(
    r"(-?\d+(?:\.\d+)?)\s*(°?[a-zA-Z°]+)\s+(?:to|in|into|as)\s+(°?[a-zA-Z]+)", re.IGNORECASE
)
_QUOTED_RE = re.compile(r"[\"“'‘](.+?)[\"”'’](?:\s|$|[?.!,])", re.DOTALL)
_IANA_RE = re.compile(r"\b([A-Z][A-Za-z_]+/[A-Z][A-Za-z_]+(?:/[A-Z][A-Za-z_]+)?)\b")


@dataclass(frozen=True, slots=True)
class PlannedCall:
    tool: str
    args: dict[str, Any]
    why: str

    def key(self) -> tuple[str, str]:
        return self.tool, json.dumps(self.args, sort_keys=True)


def plan(text: str) -> list[PlannedCall]:
    """The tool calls that answer ``text``: one per sub-question it recognises, duplicates dropped."""
    calls: list[PlannedCall] = []
    # Bounded input keeps every pattern below cheap, whatever a user pastes.
    for segment in re.split(r"[?;\n]+|(?<=[.!])\s+", text[:MAX_PLAN_CHARS]):
        segment = segment[:MAX_CLAUSE_CHARS]
        parts = [p for p in re.split(r"\s*,?\s+and\s+|\s+&\s+", segment, flags=re.IGNORECASE) if p.strip()]
        planned = [c for c in (_plan_clause(p) for p in parts) if c is not None]
        if len(planned) < 2:
            whole = _plan_clause(segment)
            planned = [whole] if whole is not None else planned
        for call in planned:
            if call.key() not in {c.key() for c in calls}:
                calls.append(call)
    return calls[:MAX_PLANNED_CALLS]


def _plan_clause(clause: str) -> PlannedCall | None:
    text = clause.strip()
    low = text.lower()
    if not text:
        return None
    if re.search(r"\b(list|show|read|what are|see)\b.*\bnotes\b", low) or re.fullmatch(r"(my )?notes", low):
        return PlannedCall("list_notes", {}, "List the saved notes.")
    note = re.search(
        r"\b(?:save|take|make|add|write down|store)\b.*?\bnote\b\s*(?:that|saying|:)?\s*(.*)", text, re.I
    )
    remember = re.match(r"\s*remember (?:that )?(.+)", text, re.I)
    if note or remember:
        content = (note.group(1) if note else remember.group(1) if remember else "").strip(" :.")
        if content:
            title = " ".join(content.split()[:5])
            return PlannedCall("save_note", {"title": title, "content": content}, "Save the note.")
    report = re.search(
        r"\b(?:write|create|make|draft|generate|prepare)\b.*?\breport\b(?:\s+(?:about|on|for)\s+(.+))?",
        text,
        re.I,
    )
    if report:
        topic = (report.group(1) or "your question").strip(" .")
        return PlannedCall(
            "write_report",
            {"title": f"Report on {topic}", "content": _report_body(topic)},
            "Write the report.",
        )
    if re.search(r"\b(count|how many)\b.*\b(words?|characters?|letters?)\b", low):
        quoted = _QUOTED_RE.search(text)
        after = re.search(r"(?:\bin\b|\bof\b|:)\s*(.+)$", text)
        sample = quoted.group(1) if quoted else (after.group(1).strip() if after else "")
        if sample:
            return PlannedCall("word_count", {"text": sample}, "Count the words.")
    if re.search(r"\b(time|clock|date|what day)\b", low):
        return PlannedCall("current_time", {"timezone": _zone_in(text)}, "Look up the current time.")
    conversion = _CONVERT_RE.search(text)
    if conversion and conversion.group(2).lower() in UNITS and conversion.group(3).lower() in UNITS:
        value = float(conversion.group(1))
        args = {
            "value": int(value) if value.is_integer() else value,
            "from_unit": conversion.group(2),
            "to_unit": conversion.group(3),
        }
        return PlannedCall("unit_convert", args, "Convert the units.")
    expression = math_expression(text)
    if expression is not None:
        return PlannedCall("calculator", {"expression": expression}, f"Calculate {expression}.")
    return None


def _zone_in(text: str) -> str:
    iana = _IANA_RE.search(text)
    if iana:
        return iana.group(1)
    low = text.lower()
    for city in sorted(CITY_ZONES, key=len, reverse=True):
        if re.search(rf"\b{re.escape(city)}\b", low):
            return CITY_ZONES[city]
    return "UTC"


def math_expression(text: str) -> str | None:
    """The longest arithmetic expression in ``text`` ("What is 17*23?" -> "17*23"), or None."""
    normal = text
    for pattern, repl in _WORD_OPS:
        normal = re.sub(pattern, repl, normal, flags=re.IGNORECASE)
    best: str | None = None
    pos = 0
    while pos < len(normal):
        run: list[str] = []
        end = pos
        while (match := _MATH_TOKEN_RE.match(normal, end)) is not None:
            run.append(match.group(1))
            end = match.end()
        if run:
            candidate = _tidy(run)
            if candidate is not None and (best is None or len(candidate) > len(best)):
                best = candidate
            pos = max(end, pos + 1)
        else:
            pos += 1
    return best


def _tidy(tokens: list[str]) -> str | None:
    """Trim a run of math tokens to a plausible expression, or None if it is not one."""
    while tokens and (tokens[-1] in _OPERATORS or tokens[-1] in (",", "(")):
        tokens = tokens[:-1]
    while tokens and ((tokens[0] in _OPERATORS and tokens[0] not in ("+", "-")) or tokens[0] in (",", ")")):
        tokens = tokens[1:]
    while tokens and tokens[0] == "(" and tokens.count("(") > tokens.count(")"):
        tokens = tokens[1:]
    while tokens and tokens[-1] == ")" and tokens.count(")") > tokens.count("("):
        tokens = tokens[:-1]
    numbers = sum(1 for t in tokens if t[0].isdigit() or t.lower() == "pi")
    operators = sum(1 for t in tokens if t in _OPERATORS)
    functions = sum(1 for t in tokens if t.isalpha() and t.lower() != "pi")
    if numbers == 0 or (operators == 0 and functions == 0) or tokens.count("(") != tokens.count(")"):
        return None
    text = ""
    for token in tokens:
        if text and text[-1].isalnum() and token[0].isalnum():
            text += " "
        text += token
    # A date is not a subtraction.
    return None if re.fullmatch(r"\d{4}-\d{1,2}-\d{1,2}", text) else text


def _report_body(topic: str) -> str:
    return (
        f"## Overview\n\nThis is a short report on **{topic}**, written by the built-in demo model. "
        "A real model would research the topic and fill this page with findings.\n\n"
        "## Key points\n\n- What the topic is and why it matters\n- The main facts and figures\n"
        "- Open questions and next steps\n"
    )

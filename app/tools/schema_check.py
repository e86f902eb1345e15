"""Tool arguments checked against the tool's JSON Schema (a person's edit of a call's arguments,
RUNS.md A-03: refused with 422 before it can reach the tool)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError


def argument_errors(schema: Mapping[str, Any], args: Mapping[str, Any], *, limit: int = 5) -> list[str]:
    """What is wrong with ``args`` for a tool whose parameters ``schema`` describes: at most
    ``limit`` messages, each naming where (empty: they fit). A schema that is itself invalid
    checks nothing (the tool validates its own arguments)."""
    try:
        validator = Draft202012Validator(dict(schema))
        errors = sorted(validator.iter_errors(dict(args)), key=lambda e: list(e.absolute_path))
    except (SchemaError, ValueError, TypeError, LookupError):
        # An invalid or unusual schema (unknown type, bad pattern...): the tool checks its own.
        return []
    out: list[str] = []
    for error in errors[:limit]:
        where = "/".join(str(p) for p in error.absolute_path)
        out.append(f"{where}: {error.message}" if where else error.message)
    return out


def schema_errors(schema: Mapping[str, Any]) -> list[str]:
    """What makes ``schema`` no JSON Schema (2020-12) at all (empty: it is one): a tool the client
    declares must be callable with what the model sends. Only references within the schema itself
    (``#...``) are admitted: nothing a client declares may make the service fetch a URL or read a
    file (jsonschema would, for a ``$ref`` it met while validating)."""
    for ref in _references(schema):
        if not ref.startswith("#"):
            return [f"$ref {ref[:100]!r}: only references within the schema (#...) are accepted"]
    try:
        Draft202012Validator.check_schema(dict(schema))
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return [f"{where}: {exc.message}" if where else exc.message]
    except (ValueError, TypeError, LookupError, RecursionError) as exc:
        return [str(exc)[:200]]
    return []


def _references(value: Any) -> list[str]:
    """Every ``$ref``/``$dynamicRef`` string in a schema, however deep."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for key, inner in item.items():
                if key in ("$ref", "$dynamicRef") and isinstance(inner, str):
                    found.append(inner)
                else:
                    stack.append(inner)
        elif isinstance(item, list):
            stack.extend(item)
    return found

"""Hostile tool calls through the running service: a model (or whoever steers it) asks the built-in
tools for code execution, unbounded arithmetic, or arguments no parser should choke on. Each call
is refused with an error the model can read, in bounded time, and the run ends normally."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from app.tools.registry import Tool
from tests.integration.service.conftest import ServiceFactory
from tests.support.fake_openai import FakeOpenAIServer, FakeReply

pytestmark = pytest.mark.timeout(60)
SQLITE = pytest.mark.parametrize("database_backend", ["sqlite"])


def hostile_expressions(marker: Path) -> list[str]:
    return [
        "9**9**9**9",
        "10**10000000",
        "2**2**2**2**2**2",
        "((10**10)**10)**10",
        "1" + "*99999999" * 50,
        "1.0000001**(10**20)",
        "(" * 240 + "1" + ")" * 240,
        "(" * 10_000 + "1" + ")" * 10_000,
        "-" * 450 + "1",
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w').write('x')",
        "().__class__.__base__.__subclasses__()",
        "[x for x in range(10**9)]",
        "lambda: 1",
        "exec('1')",
        "max(*[9] * 10**8)",
    ]


def calls_then_answer(calls: list[tuple[str, Any]]) -> Any:
    """The first call asks for every tool call at once; any later one (the loop again, a context
    compaction) gets plain text, and the streamed answer says so."""
    asked: list[bool] = []

    def handle(body: dict[str, Any]) -> FakeReply:
        if body.get("stream"):
            return FakeReply.stream(["All ", "refused."])
        if asked:
            return FakeReply.text("All refused.")
        asked.append(True)
        return FakeReply.tool_calls(calls)

    return handle


def iteration_results(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e["data"]
        for e in events
        if e["event"] == "step" and e["data"].get("type") == "iteration" and e["data"]["status"] == "done"
    ]


@SQLITE
def test_hostile_calculator_calls_are_refused_quickly_and_the_run_ends_normally(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    expressions = hostile_expressions(marker)
    fake_llm.set_handler(calls_then_answer([("calculator", {"expression": e}) for e in expressions]))
    svc = service(llm=fake_llm, tool_rate_limit_per_minute=1000)
    api = svc.api()
    conv = api.create_conversation({"agent": {"mode": "native", "tools": ["calculator"]}})

    started = time.monotonic()
    outcome = api.run(conv["id"], "Compute these.")
    took = time.monotonic() - started

    assert outcome.done["status"] == "completed", outcome.done
    assert took < 10, took
    results = iteration_results(api.run_events(outcome.run_id))
    assert len(results) == len(expressions)
    for result in results:
        assert result["error"], result
    assert not marker.exists()
    assert api.http.get("/healthz").status_code == 200


@SQLITE
def test_arguments_no_parser_should_choke_on_become_tool_errors_and_the_run_ends_normally(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    deep = "[" * 10_000 + "]" * 10_000
    calls: list[tuple[str, Any]] = [
        ("calculator", '{"expression": ' + deep + "}"),
        ("calculator", deep),
        ("calculator", "[1, 2, 3]"),
        ("calculator", '{"expression": 1' + "0" * 5000 + "}"),
        ("calculator", '{"expression": "1+1", "expression": ["2"]}'),
        ("calculator", '{"expression": NaN}'),
        ("calculator", "not json at all {"),
        ("unit_convert", '{"value": 1e999, "from_unit": "m", "to_unit": "ft"}'),
        ("unit_convert", '{"value": NaN, "from_unit": "m", "to_unit": "ft"}'),
        ("word_count", '{"text": "' + "a'" * 99_000 + '"}'),
        ("current_time", '{"timezone": "/etc/localtime"}'),
        ("current_time", '{"timezone": "../../../../etc/passwd"}'),
        ("write_report", '{"title": "../../etc/passwd", "content": "x"}'),
    ]
    fake_llm.set_handler(calls_then_answer(calls))
    svc = service(llm=fake_llm, tool_rate_limit_per_minute=1000)
    api = svc.api()
    conv = api.create_conversation({"agent": {"mode": "native"}})

    started = time.monotonic()
    outcome = api.run(conv["id"], "Use the tools.")
    took = time.monotonic() - started

    assert outcome.done["status"] == "completed", outcome.done
    assert took < 10, took
    results = iteration_results(api.run_events(outcome.run_id))
    assert len(results) == len(calls)
    by_call = dict(zip((f"{name} {args[:40]}" for name, args in calls), results, strict=True))
    errors = {call: r for call, r in by_call.items() if not r["error"]}
    # What may succeed: the word count (bounded work) and the report (its file name is a slug).
    assert {call.split()[0] for call in errors} <= {"word_count", "write_report", "calculator"}, errors
    for call, result in errors.items():
        if call.startswith("calculator"):
            assert result["observation"] == "1+1 = 2", (call, result)
        if call.startswith("write_report"):
            assert " to etc-passwd.md " in result["observation"], result


def binary_tool() -> Tool:
    async def read_binary() -> str:
        return "bytes: \x00\x01\ud800\udcff end"

    return Tool(
        name="read_binary",
        description="Returns text as a careless tool might: with NUL and lone surrogates.",
        parameters={"type": "object", "properties": {}},
        func=read_binary,
        timeout_s=5.0,
    )


@pytest.mark.parametrize("database_backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_text_no_database_can_store_from_a_tool_or_the_model_still_ends_the_run(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    def handle(body: dict[str, Any]) -> FakeReply:
        if body.get("stream"):
            return FakeReply.stream(["The ", "answer\x00", " ends."])
        if any(m.get("role") == "tool" for m in body["messages"]):
            return FakeReply.text("Done\x00.")
        return FakeReply.tool_calls([("read_binary", {})], content="Reading\x00 it.")

    fake_llm.set_handler(handle)
    svc = service(llm=fake_llm)
    svc.add_tool(binary_tool())
    api = svc.api()
    conv = api.create_conversation({"agent": {"mode": "native"}})

    outcome = api.run(conv["id"], "Read it.")

    done = outcome.done
    assert done["status"] == "completed", done
    observation = iteration_results(api.run_events(outcome.run_id))[0]["observation"]
    assert observation == "bytes: \ufffd\x01\ufffd\ufffd end"
    run = api.get_run(outcome.run_id)
    assert run["status"] == "completed"
    # What the database cannot hold is stored as U+FFFD; the stream keeps what the model sent.
    assert run["answer"] == done["answer"].replace("\x00", "\ufffd")
    stored = api.conversation(conv["id"])["messages"]
    assert any(m["role"] == "tool" and m["content"] == observation for m in stored)

"""LOG_FORMAT=json: one JSON object a line, carrying the run and conversation of the task that logged."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from app.observability import JsonFormatter, configure_logging, conversation_id_var, run_id_var


def logged_lines(capsys: pytest.CaptureFixture[str], write: Callable[[], None]) -> list[dict[str, Any]]:
    """What ``write`` logs through the service's JSON handler, as objects."""
    configure_logging("json", "INFO")
    try:
        write()
    finally:
        app_logger = logging.getLogger("app")
        for handler in [h for h in app_logger.handlers if getattr(h, "_agentstream", False)]:
            app_logger.removeHandler(handler)  # it writes to this test's captured stderr
    return [json.loads(line) for line in capsys.readouterr().err.strip().splitlines()]


def test_json_log_lines_carry_run_and_conversation_ids(capsys: pytest.CaptureFixture[str]) -> None:
    def write() -> None:
        run_token = run_id_var.set("run_abc")
        conv_token = conversation_id_var.set("conv_xyz")
        try:
            logging.getLogger("app.runs").info("run started", extra={"worker": "w1"})
        finally:
            run_id_var.reset(run_token)
            conversation_id_var.reset(conv_token)

    record = logged_lines(capsys, write)[-1]
    assert record["msg"] == "run started"
    assert record["run_id"] == "run_abc"
    assert record["conversation_id"] == "conv_xyz"
    assert record["worker"] == "w1"
    assert record["level"] == "info"
    assert "trace_id" not in record and "span_id" not in record  # no span, no ids


def test_a_line_written_inside_a_span_carries_its_trace_and_span_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tracer = TracerProvider().get_tracer("test")

    def write() -> None:
        with tracer.start_as_current_span("run") as span:
            logging.getLogger("app.runs").info("inside")
            ids.append(span.get_span_context())
        logging.getLogger("app.runs").info("outside")

    ids: list[Any] = []
    inside, outside = logged_lines(capsys, write)[-2:]
    assert (inside["trace_id"], inside["span_id"]) == (f"{ids[0].trace_id:032x}", f"{ids[0].span_id:016x}")
    assert "trace_id" not in outside


def test_json_formatter_keeps_one_line_for_multiline_messages() -> None:
    record = logging.makeLogRecord({"msg": "a\nb", "levelname": "INFO", "name": "app"})
    assert "\n" not in JsonFormatter().format(record)

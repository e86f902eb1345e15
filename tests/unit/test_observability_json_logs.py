"""LOG_FORMAT=json: one JSON object a line, carrying the run and conversation of the task that logged."""

from __future__ import annotations

import json
import logging

import pytest

from app.observability import JsonFormatter, configure_logging, conversation_id_var, run_id_var


def test_json_log_lines_carry_run_and_conversation_ids(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", "INFO")
    run_token = run_id_var.set("run_abc")
    conv_token = conversation_id_var.set("conv_xyz")
    try:
        logging.getLogger("app.runs").info("run started", extra={"worker": "w1"})
    finally:
        run_id_var.reset(run_token)
        conversation_id_var.reset(conv_token)
        app_logger = logging.getLogger("app")
        for handler in [h for h in app_logger.handlers if getattr(h, "_agentstream", False)]:
            app_logger.removeHandler(handler)  # it writes to this test's captured stderr
    line = capsys.readouterr().err.strip().splitlines()[-1]
    record = json.loads(line)
    assert record["msg"] == "run started"
    assert record["run_id"] == "run_abc"
    assert record["conversation_id"] == "conv_xyz"
    assert record["worker"] == "w1"
    assert record["level"] == "info"


def test_json_formatter_keeps_one_line_for_multiline_messages() -> None:
    record = logging.makeLogRecord({"msg": "a\nb", "levelname": "INFO", "name": "app"})
    assert "\n" not in JsonFormatter().format(record)

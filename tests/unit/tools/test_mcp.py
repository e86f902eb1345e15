"""MCP_SERVERS parsing, tool naming and how MCP results become observations (no server needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from mcp.types import CallToolResult, EmbeddedResource, ImageContent, TextContent, TextResourceContents

from app.tools.mcp import (
    MAX_OBSERVATION_CHARS,
    HttpServerConfig,
    MCPConfigError,
    StdioServerConfig,
    parse_mcp_servers,
    result_text,
    tool_name,
)


def test_unset_or_blank_mcp_servers_means_no_servers() -> None:
    assert parse_mcp_servers(None) == []
    assert parse_mcp_servers("  ") == []


def test_stdio_and_http_entries_parse_with_their_defaults() -> None:
    configs = parse_mcp_servers(
        json.dumps(
            [
                {"name": "files", "transport": "stdio", "command": "python", "args": ["-m", "x"]},
                {"name": "web", "transport": "http", "url": "http://127.0.0.1:9000/mcp", "timeout_s": 5},
            ]
        )
    )

    files, web = configs
    assert isinstance(files, StdioServerConfig)
    assert (files.command, files.args, files.env, files.timeout_s) == ("python", ["-m", "x"], {}, 30.0)
    assert isinstance(web, HttpServerConfig)
    assert (web.url, web.timeout_s, web.headers) == ("http://127.0.0.1:9000/mcp", 5.0, {})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("not json", "MCP_SERVERS is not valid JSON"),
        ('{"name": "x"}', "must be a JSON list"),
        ('[{"name": "files", "transport": "stdio"}]', "entry 0 ('files'): command: Field required"),
        ('[{"name": "w", "transport": "ws", "url": "x"}]', "entry 0 ('w'): 'transport' must be"),
        ('[{"name": "w", "transport": "http", "url": "ftp://x"}]', "entry 0 ('w'): url:"),
        ('[{"name": "a__b", "transport": "http", "url": "http://x"}]', "not contain '__'"),
        ('[{"name": "a b", "transport": "http", "url": "http://x"}]', "entry 0 ('a b'): name:"),
        (
            '[{"name": "w", "transport": "http", "url": "http://x", "comand": "typo"}]',
            "comand: Extra inputs are not permitted",
        ),
        (
            '[{"name": "w", "transport": "http", "url": "http://x"},'
            ' {"name": "w", "transport": "http", "url": "http://y"}]',
            "the server name 'w' is used twice",
        ),
    ],
)
def test_invalid_mcp_servers_config_is_refused_with_a_message_naming_the_problem(
    raw: str, message: str
) -> None:
    with pytest.raises(MCPConfigError) as caught:
        parse_mcp_servers(raw)

    assert message in str(caught.value)


def test_tool_names_are_prefixed_by_the_server_and_safe_for_providers() -> None:
    assert tool_name("files", "read_file") == "files__read_file"
    assert tool_name("web", "fetch.page/v2") == "web__fetch_page_v2"
    assert len(tool_name("s", "x" * 200)) == 64


def _result(*content: Any, is_error: bool = False, structured: Any = None) -> CallToolResult:
    return CallToolResult(content=list(content), is_error=is_error, structured_content=structured)


def test_text_blocks_become_the_observation_and_other_blocks_are_described() -> None:
    result = _result(
        TextContent(type="text", text="first"),
        ImageContent(type="image", data="aGVsbG8=", mime_type="image/png"),
        EmbeddedResource(
            type="resource",
            resource=TextResourceContents(uri="file:///a.txt", text="embedded text", mime_type="text/plain"),
        ),
    )

    assert result_text(result) == "first\n[image image/png, 8 base64 characters]\nembedded text"


def test_structured_content_is_the_observation_when_there_is_no_content() -> None:
    assert result_text(_result(structured={"sum": 5})) == '{"sum":5}'


def test_a_huge_result_is_cut_with_a_note() -> None:
    text = result_text(_result(TextContent(type="text", text="x" * (MAX_OBSERVATION_CHARS + 10))))

    assert text.startswith("x" * MAX_OBSERVATION_CHARS)
    assert text.endswith(f"[… cut at {MAX_OBSERVATION_CHARS} characters]")

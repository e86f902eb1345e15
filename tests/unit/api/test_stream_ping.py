"""The keep-alive comment is framed like the events: LF line ends, one blank line."""

from __future__ import annotations

from app.api.routes.stream import ping_event
from app.streaming.sse import PING


def test_ping_comment_uses_lf_line_ends_like_the_events() -> None:
    assert ping_event().encode() == b": ping\n\n"
    assert ping_event().encode() == PING

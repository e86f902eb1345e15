"""Commands packed from kept RESP parts are the bytes hiredis packs from the arguments."""

from __future__ import annotations

import hiredis
import pytest

from app.streaming.redis_wire import array_header, bulk


@pytest.mark.parametrize(
    "args",
    [
        ("XREAD", "COUNT", "1000", "BLOCK", "1000", "STREAMS", "as:conv:c1", "0-0"),
        ("XREAD", "STREAMS", "as:conv:é", "ключ", "1700000000000-12", "1700000000000-13"),
        ("PING",),
        ("SET", "", ""),
    ],
)
def test_a_command_packed_from_parts_is_what_hiredis_packs(args: tuple[str, ...]) -> None:
    packed = array_header(len(args)) + b"".join(bulk(a) for a in args)
    assert packed == hiredis.pack_command(args)

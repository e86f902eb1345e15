"""A worker's room for runs (RUNS.md Q-01): it executes at most ``MAX_ACTIVE_RUNS`` attempts at once.

The attempts it executes hold room (a run waiting for a person is executed nowhere and holds
none), and so does a run being started or taken over here, from the moment the decision is made
until its attempt is under way: two starts at once cannot both take the last place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sized


class Room:
    def __init__(self, limit: int, active: Sized) -> None:
        self.limit = limit
        self._active = active
        self._reserved = 0

    def free(self) -> int:
        """Places left now (never below zero)."""
        return max(0, self.limit - len(self._active) - self._reserved)

    @contextlib.contextmanager
    def reserve(self, wanted: int = 1) -> Iterator[int]:
        """Hold up to ``wanted`` places while runs are started or taken over here; yields how
        many are held (0: none was free). An attempt launched meanwhile holds its place from
        then on."""
        held = min(wanted, self.free())
        self._reserved += held
        try:
            yield held
        finally:
            self._reserved -= held

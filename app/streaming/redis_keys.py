"""``RedisKeys``: the name of every Redis key and channel the service uses, in one place.

On one Redis the names are those every earlier version used (workers of mixed versions share one
Redis during a rolling deploy). On a Redis Cluster (RUNS.md S-01) every key of a conversation, and
of its runs, carries the conversation id as hash tag (``{prefix}:events:{<conversation_id>}``), so
that a conversation's operations stay on one slot and conversations spread over every master.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str
    cluster: bool = False

    def _tagged(self, kind: str, conversation_id: str) -> str:
        if self.cluster:
            return f"{self.prefix}:{kind}:{{{conversation_id}}}"
        return f"{self.prefix}:{kind}:{conversation_id}"

    def events(self, conversation_id: str) -> str:
        """The conversation's Redis Stream."""
        return self._tagged("events", conversation_id)

    def wake(self, conversation_id: str) -> str:
        """The sharded channel announcing appends to the conversation's stream (cluster only)."""
        return self._tagged("wake", conversation_id)

    def followups(self, conversation_id: str) -> str:
        """The token that changes with every follow-up of the conversation."""
        return self._tagged("followups", conversation_id)

    def signal_channel(self, name: str) -> str:
        """The channel of a run signal (``cancel``, ``released``); classic pub/sub reaches every node."""
        return f"{self.prefix}:{name}"

    def signal(self, name: str, run_id: str, conversation_id: str | None = None) -> str:
        """The key that keeps a run signal (``cancel``, ``released``) for a late check.

        On a cluster it hashes with the run's conversation when the caller names it, else on the
        run id (a key of its own, still one slot); a request and its check must agree on that.
        """
        if not self.cluster:
            return f"{self.prefix}:{name}:{run_id}"
        if conversation_id is None:
            return f"{self.prefix}:{name}:{{{run_id}}}"
        return f"{self.prefix}:{name}:{{{conversation_id}}}:{run_id}"

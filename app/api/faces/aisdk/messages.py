"""A chat's current branch as the AI SDK's ``UIMessage[]`` (FACES.md V-06).

A user's question is a user message with the id the client gave it (``msg_<n>`` for one it did
not name); everything a run added below it is one assistant message, id the run's, built from the
run's stored events by the same chunks a client streamed and folded the same way, so it equals
what that client holds. Messages no run wrote (the earlier messages a chat was created with) are
text messages. Follow-ups a run took show inside its message (``data-agentstream-inject``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from app.api.faces.aisdk.chunks import ClientOutput, MessageChunks
from app.api.faces.aisdk.fold import MessageFold
from app.api.faces.follow import is_waiting
from app.container import Services
from app.db.repositories import FINAL_STATUSES, ConversationRecord, MessageRecord, RunRecord
from app.db.repositories.rows import path_to


def client_outputs(services: Services, run_id: str) -> ClientOutput:
    """The results of ``run``'s client calls (call ids are unique within a run only), read once,
    and again for a call not answered at the last read."""
    outputs: dict[str, dict[str, Any] | None] = {}

    async def output(call_id: str) -> dict[str, Any] | None:
        if outputs.get(call_id) is None:
            calls = await services.approvals.of_run(run_id)
            outputs.update((c.call_id, c.output) for c in calls if c.kind == "client")
        return outputs.get(call_id)

    return output


_FINISHED: OrderedDict[str, dict[str, Any]] = OrderedDict()
"""The messages of finished runs, which never change again (the most recently used ones)."""
FINISHED_KEPT = 512


async def run_message(services: Services, run: RunRecord) -> dict[str, Any]:
    """The assistant message of ``run`` as its stored events make it."""
    kept = _FINISHED.get(run.id)
    if kept is not None:
        _FINISHED.move_to_end(run.id)
        return kept
    message = await _folded(services, run)
    if run.status in FINAL_STATUSES and message.get("metadata", {}).get("status") == run.status:
        _FINISHED[run.id] = message  # its done is folded in: nothing of it can change any more
        while len(_FINISHED) > FINISHED_KEPT:
            _FINISHED.popitem(last=False)
    return message


async def _folded(services: Services, run: RunRecord) -> dict[str, Any]:
    chunks = MessageChunks(run.id, client_outputs(services, run.id))
    fold = MessageFold()
    fold.feed(chunks.start())
    events = await services.events.for_run(run.id)
    for event in events:
        fold.feed(await chunks.event(event))
    if events and is_waiting(events[-1]) and run.status == "waiting":
        fold.feed(chunks.park())
    return fold.message


def _user(record: MessageRecord) -> dict[str, Any]:
    return {
        "id": record.client_id or record.public_id,
        "role": "user",
        "parts": [{"type": "text", "text": record.content or ""}],
    }


async def ui_messages(services: Services, conv: ConversationRecord) -> list[dict[str, Any]]:
    records, head = await services.conversations.branch(conv.id)
    path = path_to(records, head)
    runs: dict[str, RunRecord | None] = {}

    async def run_of(run_id: str) -> RunRecord | None:
        if run_id not in runs:
            runs[run_id] = await services.runs.get(conv.owner, run_id)
        return runs[run_id]

    out: list[dict[str, Any]] = []
    shown: set[str] = set()
    for record in path:
        run = await run_of(record.run_id) if record.run_id else None
        if record.role == "user" and (run is None or run.question_seq == record.seq):
            out.append(_user(record))
            continue
        if run is None:
            if record.role == "assistant" and record.content:
                text = {"type": "text", "text": record.content, "state": "done"}
                out.append({"id": record.client_id or record.public_id, "role": "assistant", "parts": [text]})
            continue
        if run.id not in shown:  # a follow-up or a step of a run already shown is inside its message
            shown.add(run.id)
            out.append(await run_message(services, run))
    # The leaf's question may have a run that has stored nothing below it yet (it works, waits,
    # or failed before its first message).
    if path and path[-1].role == "user":
        latest = await services.runs.latest(conv.id)
        if latest is not None and latest.question_seq == path[-1].seq and latest.id not in shown:
            out.append(await run_message(services, latest))
    return out

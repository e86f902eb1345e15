"""The thread as an AG-UI client holds it: ``MESSAGES_SNAPSHOT`` (FACES.md G-03, G-04).

``RunFold`` folds a run's stored events into the messages its AG-UI events made, under ids derived
from stored data (design note D1.2): ``rsn_<run>_<n>`` the reasoning of iteration n,
``asst_<run>_<n>`` the reply holding its tool calls, ``tool_<call id>`` a server tool's result,
``ans_<run>_<attempt>`` the answer (``…_f`` when a failed synthesis's fallback replaced the text
streamed), ``inj_<event id>`` a follow-up folded in; a client tool's result keeps the id of the
tool message the client sent it in. The translator folds the run it streams with the same
``RunFold``, so the ids of its events and of every later snapshot agree by construction, live,
replayed or after a restart (D1.1). A ``resumed`` phase takes back what the lost attempt did after
its checkpoint, as a client that followed it is told to (D1.6).

``ThreadView`` puts the folds of a thread's runs between the messages stored on its current
branch: the questions (under the client's ids), and the history a new thread came with. A finished
run's messages (its ``done`` folded in) never change again: the process keeps the most recently
used ones (``FOLDS_KEPT``), so that a thread's snapshot reads its earlier runs' events once, not
at every request; those it lacks are read together (one query, or pages of the conversation's
events when several are missing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from ag_ui.core import (
    AssistantMessage,
    FunctionCall,
    Message,
    ReasoningMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)

from app.api.faces.follow import payload
from app.container import Services
from app.db.repositories import ConversationRecord
from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.rows import MessageRecord, path_to
from app.streaming.bus import StoredEvent, parse_cursor

FOLDS_KEPT = 512
"""How many finished runs' messages the process keeps (the most recently used)."""
_FINISHED: OrderedDict[str, tuple[Message, ...]] = OrderedDict()
"""The messages of finished runs, by run id: their ``done`` is folded in, nothing of them can
change any more (a client tool's result came before the run went on; a run ends once)."""
EVENT_PAGE = 1000
"""Events a page when the events of several runs are read at once (a conversation's, in order)."""


def reasoning_id(run_id: str, iteration: int) -> str:
    return f"rsn_{run_id}_{iteration}"


def assistant_id(run_id: str, iteration: int) -> str:
    return f"asst_{run_id}_{iteration}"


def tool_message_id(call_id: str) -> str:
    return f"tool_{call_id}"


def arguments_text(args: Any) -> str:
    """A call's arguments as AG-UI carries them: one JSON text (``TOOL_CALL_ARGS`` and snapshots)."""
    return orjson.dumps(args).decode()


@dataclass(frozen=True, slots=True)
class ClientResult:
    """A client tool's result as the client sent it in a ``tool`` message (FACES.md C-03)."""

    message_id: str
    content: str
    error: str | None


def client_results(records: Iterable[ApprovalRecord]) -> dict[str, ClientResult]:
    """The results that came in AG-UI tool messages (their id kept beside the output), by call."""
    out: dict[str, ClientResult] = {}
    for record in records:
        output = record.output or {}
        message_id = output.get("message_id")
        if record.kind != "client" or record.status != "answered" or not isinstance(message_id, str):
            continue
        if "error" in output:
            out[record.call_id] = ClientResult(
                message_id, str(output.get("content") or ""), str(output["error"])
            )
        else:
            value = output.get("output")
            content = value if isinstance(value, str) else orjson.dumps(value).decode()
            out[record.call_id] = ClientResult(message_id, content, None)
    return out


@dataclass(slots=True)
class Call:
    call_id: str
    name: str
    arguments: str
    client: bool = False
    result: tuple[str, str | None] | None = None
    """``(observation, error)`` from its ``iteration done``."""


@dataclass(slots=True)
class Iteration:
    number: int
    reasoning: str = ""
    calls: dict[str, Call] = field(default_factory=dict)


@dataclass(slots=True)
class Said:
    """A message of the run that is text alone: a follow-up folded in, the answer."""

    id: str
    role: str
    text: str = ""


class RunFold:
    """A run's events folded into the messages an AG-UI client holds of it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._events: list[StoredEvent] = []
        self._clear()

    def _clear(self) -> None:
        self.entries: list[Iteration | Said] = []
        self.iterations: dict[int, Iteration] = {}
        self.iteration = 0
        self.attempt = 1
        self.answer: Said | None = None
        self.streamed = ""
        """The answer's text as its deltas came (the fold's answer may be the fallback instead)."""
        self.done: dict[str, Any] | None = None
        self.calls_of_approvals: dict[str, str] = {}

    @property
    def has_client_calls(self) -> bool:
        return any(c.client for it in self.iterations.values() for c in it.calls.values())

    def apply(self, event: StoredEvent) -> None:
        if event.event == "phase" and payload(event).get("phase") == "resumed":
            self._take_back(event)
            return
        self._events.append(event)
        self._apply(event)

    def _take_back(self, resumed: StoredEvent) -> None:
        """A new attempt goes on from its checkpoint: what came after ``after`` is undone."""
        data = payload(resumed)
        try:
            limit = parse_cursor(str(data.get("after")))
        except ValueError:
            limit = parse_cursor(resumed.id)
        kept = [e for e in self._events if parse_cursor(e.id) <= limit]
        self._events = []
        self._clear()
        for event in kept:
            self._events.append(event)
            self._apply(event)
        self._events.append(resumed)
        self._apply(resumed)

    def _at(self, number: int) -> Iteration:
        found = self.iterations.get(number)
        if found is None:
            found = self.iterations[number] = Iteration(number)
            self.entries.append(found)
        return found

    def call(self, data: Mapping[str, Any]) -> Call:
        """The call an ``iteration`` step or an ``approval`` request names, known from now on."""
        number = data.get("iteration")
        iteration = self._at(number if isinstance(number, int) else self.iteration)
        call_id = str(data.get("call_id"))
        call = iteration.calls.get(call_id)
        if call is None:
            call = iteration.calls[call_id] = Call(call_id, str(data.get("tool_name")), "")
        if "tool_args" in data:
            call.arguments = arguments_text(data.get("tool_args"))
        call.client = call.client or bool(data.get("client"))
        return call

    def _apply(self, event: StoredEvent) -> None:
        data = payload(event)
        kind = event.event
        if kind == "step":
            self._step(data)
        elif kind == "approval" and data.get("status") == "requested":
            self.call(data)
            self.calls_of_approvals[str(data.get("approval_id"))] = str(data.get("call_id"))
        elif kind == "phase" and data.get("phase") == "resumed":
            attempt = data.get("attempt")
            self.attempt = attempt if isinstance(attempt, int) else self.attempt + 1
        elif kind == "inject":
            self.entries.append(Said(f"inj_{event.id}", "user", str(data.get("content") or "")))
        elif kind == "answer":
            self._answer(data)
        elif kind == "done":
            self._done(data)

    def _step(self, data: Mapping[str, Any]) -> None:
        if data.get("type") == "thinking":
            number = data.get("iteration")
            if isinstance(number, int):
                self.iteration = number
            iteration = self._at(self.iteration)
            if data.get("status") == "done":
                iteration.reasoning = str(data.get("reasoning") or "")
        elif data.get("type") == "iteration":
            call = self.call(data)
            if data.get("status") == "done":
                error = data.get("error")
                call.result = (str(data.get("observation") or ""), str(error) if error is not None else None)

    def _answer(self, data: Mapping[str, Any]) -> None:
        status = data.get("status")
        if status == "start":
            if self.answer is not None and self.answer in self.entries:
                self.entries.remove(self.answer)  # an answer started again: the last one stands
            self.answer = Said(f"ans_{self.run_id}_{self.attempt}", "assistant")
            self.entries.append(self.answer)
            self.streamed = ""
        elif status == "delta":
            if self.answer is None:
                self._answer({"status": "start"})
            assert self.answer is not None
            self.streamed += str(data.get("content") or "")
            self.answer.text = self.streamed

    def _done(self, data: Mapping[str, Any]) -> None:
        self.done = dict(data)
        final = data.get("answer")
        if data.get("status") != "completed" or not isinstance(final, str) or final == self.streamed:
            return
        if self.answer is None or not self.streamed:
            # Nothing streamed (an answer written without synthesis): the answer, under its id.
            if self.answer is None:
                self.answer = Said(f"ans_{self.run_id}_{self.attempt}", "assistant")
                self.entries.append(self.answer)
            self.answer.text = final
            return
        # A synthesis that failed mid-stream (ENGINE E-04): the fallback replaces the partial text.
        self.entries.remove(self.answer)
        self.answer = Said(f"ans_{self.run_id}_{self.attempt}_f", "assistant", final)
        self.entries.append(self.answer)

    def messages(self, results: Mapping[str, ClientResult]) -> list[Message]:
        """The run's messages, in order; ``results``: the client's tool messages, by call."""
        out: list[Message] = []
        for entry in self.entries:
            if isinstance(entry, Said):
                if entry.role == "user":
                    out.append(UserMessage(id=entry.id, content=entry.text))
                elif entry.text:
                    out.append(AssistantMessage(id=entry.id, content=entry.text))
                continue
            out.extend(self._iteration_messages(entry, results))
        late = (self.done or {}).get("pending_injections") or []
        for index, content in enumerate(late):
            out.append(UserMessage(id=f"inj_{self.run_id}_late_{index}", content=str(content)))
        return out

    def _iteration_messages(self, iteration: Iteration, results: Mapping[str, ClientResult]) -> list[Message]:
        out: list[Message] = []
        if iteration.reasoning:
            out.append(
                ReasoningMessage(id=reasoning_id(self.run_id, iteration.number), content=iteration.reasoning)
            )
        if not iteration.calls:
            return out
        calls = [
            ToolCall(id=c.call_id, function=FunctionCall(name=c.name, arguments=c.arguments or "{}"))
            for c in iteration.calls.values()
        ]
        out.append(AssistantMessage(id=assistant_id(self.run_id, iteration.number), tool_calls=calls))
        for call in iteration.calls.values():
            held = results.get(call.call_id) if call.client else None
            if held is not None:
                out.append(
                    ToolMessage(
                        id=held.message_id, content=held.content, tool_call_id=call.call_id, error=held.error
                    )
                )
            elif call.result is not None:
                observation, error = call.result
                out.append(
                    ToolMessage(
                        id=tool_message_id(call.call_id),
                        content=observation,
                        tool_call_id=call.call_id,
                        error=error,
                    )
                )
        return out


def remember(run_id: str, messages: tuple[Message, ...]) -> None:
    """Keep a finished run's messages (its fold with its ``done``) for later snapshots."""
    _FINISHED[run_id] = messages
    _FINISHED.move_to_end(run_id)
    while len(_FINISHED) > FOLDS_KEPT:
        _FINISHED.popitem(last=False)


def stored_message(record: MessageRecord) -> Message:
    """A message stored on the branch that no run wrote (a question, a thread's first history)."""
    message_id = record.client_id or record.public_id
    content = record.content or ""
    if record.role == "assistant":
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in record.tool_calls
        ]
        return AssistantMessage(id=message_id, content=record.content, tool_calls=calls or None)
    if record.role == "tool":
        return ToolMessage(id=message_id, content=content, tool_call_id=record.tool_call_id or "")
    if record.role == "system":
        return SystemMessage(id=message_id, content=content)
    return UserMessage(id=message_id, content=content)


def _is_question(record: MessageRecord) -> bool:
    return record.role == "user" and record.run_id is not None and not record.pinned


@dataclass(slots=True)
class Thread:
    """A thread's current branch, read once: its messages, and what names them."""

    messages: list[Message]
    known_ids: set[str]
    """Every id the client may hold of the conversation's messages (every branch's)."""
    other_runs: set[str] = field(default_factory=set)
    """The conversation's runs not folded among ``messages`` (other branches'): the ids of the
    client's tool messages that answered their calls are not in ``known_ids``."""


class ThreadView:
    """The messages of a conversation's current branch, its runs' folds among them."""

    def __init__(self, services: Services, conversation: ConversationRecord) -> None:
        self.services = services
        self.conversation = conversation

    async def read(self, live: RunFold | None = None) -> Thread:
        """The thread now; ``live``: the fold of the run being streamed (its events so far)."""
        services = self.services
        records, head = await services.conversations.branch(self.conversation.id)
        path = path_to(records, head)
        answering = await self._answering(path)
        folded = set(answering.values())
        runs = await self._messages_of(folded, live)
        out: list[Message] = []
        for index, record in enumerate(path):
            if record.run_id in folded and not (_is_question(record) and index in answering):
                continue  # written by a run: its fold stands for it
            out.append(stored_message(record))
            run_id = answering.get(index)
            if run_id is not None:
                out.extend(runs[run_id])
        known = {m.id for m in out}
        known.update(r.client_id or r.public_id for r in records)
        known.update(r.public_id for r in records)
        return Thread(out, known, {r.run_id for r in records if r.run_id is not None} - folded)

    async def _messages_of(
        self, run_ids: Iterable[str], live: RunFold | None
    ) -> dict[str, Sequence[Message]]:
        """The messages of runs ``run_ids``: ``live``'s as it has them, finished runs' as kept,
        the others folded from their stored events (read together), kept once finished."""
        out: dict[str, Sequence[Message]] = {}
        missing: list[str] = []
        for run_id in run_ids:
            if live is not None and live.run_id == run_id:
                out[run_id] = live.messages(await self.results(live))
                continue
            kept = _FINISHED.get(run_id)
            if kept is None:
                missing.append(run_id)
                continue
            _FINISHED.move_to_end(run_id)
            out[run_id] = kept
        for fold in await self._folds(missing):
            messages = tuple(fold.messages(await self.results(fold)))
            if fold.done is not None:
                remember(fold.run_id, messages)
            out[fold.run_id] = messages
        return out

    async def _folds(self, run_ids: Sequence[str]) -> list[RunFold]:
        """Runs ``run_ids`` folded from their stored events: one run's read alone, several runs'
        in one pass over the conversation's events (pages of ``EVENT_PAGE``) instead of a query each."""
        if len(run_ids) <= 1:
            return [await self.fold(run_id) for run_id in run_ids]
        folds = {run_id: RunFold(run_id) for run_id in run_ids}
        cursor = "0-0"
        while True:
            page = await self.services.events.read_after(self.conversation.id, cursor, EVENT_PAGE)
            for event in page:
                fold = folds.get(event.run_id)
                if fold is not None:
                    fold.apply(event)
            if len(page) < EVENT_PAGE:
                return list(folds.values())
            cursor = page[-1].id

    async def _answering(self, path: Sequence[MessageRecord]) -> dict[int, str]:
        """The run whose messages follow each question of the path, by the question's index."""
        out: dict[int, str] = {}
        for index, record in enumerate(path):
            if not _is_question(record) or (record.run_id is not None and record.run_id in out.values()):
                continue
            after = path[index + 1] if index + 1 < len(path) else None
            run_id = record.run_id
            if after is not None and after.run_id is not None and not _is_question(after):
                run_id = after.run_id  # answered again (a regenerate through the own API)
            elif after is None:
                latest = await self.services.runs.latest(self.conversation.id)
                if latest is not None and latest.question_seq == record.seq:
                    run_id = latest.id
            if run_id is not None:
                out[index] = run_id
        return out

    async def fold(self, run_id: str) -> RunFold:
        """Run ``run_id``'s stored events, folded."""
        fold = RunFold(run_id)
        for event in await self.services.events.for_run(run_id):
            fold.apply(event)
        return fold

    async def results(self, fold: RunFold) -> dict[str, ClientResult]:
        if not fold.has_client_calls:
            return {}
        return client_results(await self.services.approvals.of_run(fold.run_id))

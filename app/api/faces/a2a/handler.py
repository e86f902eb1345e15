"""The A2A methods on runs (FACES.md N-02..N-05): the SDK's ``RequestHandler``, implemented on the
run model rather than on the SDK's task store and executor.

The SDK's request handler keeps tasks in its own store and runs an ``AgentExecutor`` in the
process that took the request; a run here is durable, carried on by whichever worker, and its
events are the stored log. So every method maps onto the run model: a task is a run (read from the
database), its stream a translation of the run's events (``translate``), a message starts a run,
adds a follow-up or decides an approval. The SDK still does the wire: JSON-RPC and HTTP+JSON
parsing, version negotiation, the 0.3 names, error shapes, SSE.

The call's owner and the services come in the call context (``routes``); another owner's task
is ``TaskNotFoundError``, as is an id that names no run (one the service could not have made is
not looked up). Whatever fails that is not an A2A error or the service's is logged (its type and
where, never its text: a database error quotes the statement's parameters) and answered as an
internal error that says no more.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.server.request_handlers.request_handler import RequestHandler, validate_request_params
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    A2AError,
    InternalError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from app.api.faces.a2a.push import checked_push_config, is_config_id, push_config_of
from app.api.faces.a2a.requests import (
    Decision,
    Inbound,
    agent_spec,
    checked_context_id,
    read_message,
)
from app.api.faces.a2a.tasks import DEFAULT_PAGE_SIZE, TaskStore, question, task_of
from app.api.faces.a2a.translate import FACE, TERMINAL, TaskEvents
from app.api.faces.follow import follow_run, is_waiting, payload, still_waits
from app.api.routes.conversations import checked_agent
from app.api.routes.stream import title_from
from app.api.schemas import is_resource_id
from app.api.settle import decide_approval, edited_args
from app.container import Services
from app.db.errors import database_unreachable
from app.db.repositories import ConversationRecord, RunRecord
from app.db.repositories.approvals import ApprovalRecord
from app.db.repositories.push_configs import NewPushConfig, PushConfigLimitError
from app.db.repositories.run_start import Placement
from app.errors import (
    ApprovalClosedConflict,
    InvalidInputError,
    NoActiveRunError,
    NotFoundError,
    RunActiveConflict,
    ServiceError,
)
from app.streaming.bus import BusUnavailableError, StoredEvent

log = logging.getLogger("app.api.faces.a2a")

ENDED = frozenset({"completed", "failed", "cancelled"})
CANCEL_WAIT_S = 10.0
"""How long ``CancelTask`` waits for the run's end to answer with its ``CANCELED`` task."""


class RefusedError(InternalError):
    """The service cannot take the request now (a full queue, a worker shutting down, a database
    or Redis outage): on HTTP+JSON the route answers with the service's status and ``Retry-After``
    (``routes``); on JSON-RPC it is an internal error whose data says so."""

    def __init__(self, error: ServiceError) -> None:
        retry = dict(error.headers).get("Retry-After")
        super().__init__(error.message, {"code": error.code, **({"retryAfter": retry} if retry else {})})
        self.error = error


class _Outage(ServiceError):
    code = "unavailable"
    status = 503
    headers = (("Retry-After", "1"),)

    def __init__(self) -> None:
        super().__init__("the database or the event bus is unreachable; retry shortly")


def a2a_error(exc: Exception) -> A2AError:
    """The A2A error of a service error (or an outage); anything else is logged and answered as an
    internal error that says nothing of it (the SDK would send its text)."""
    if isinstance(exc, A2AError):
        return exc
    if isinstance(exc, NotFoundError):
        return TaskNotFoundError()
    if isinstance(exc, InvalidInputError):
        return InvalidParamsError(exc.message)
    if isinstance(exc, ApprovalClosedConflict):
        return InvalidParamsError(exc.message)
    if isinstance(exc, RunActiveConflict):
        return UnsupportedOperationError(
            "a task of this context is still active: send the message with its taskId (a follow-up), "
            "or cancel it first"
        )
    if isinstance(exc, NoActiveRunError):
        return UnsupportedOperationError("the task has ended: it takes no more messages")
    if isinstance(exc, PushConfigLimitError):
        return InvalidParamsError(str(exc))
    if isinstance(exc, ServiceError):
        return RefusedError(exc) if exc.status in (429, 503) else InternalError(exc.message)
    if isinstance(exc, ConnectionError | TimeoutError | BusUnavailableError) or database_unreachable(exc):
        return RefusedError(_Outage())
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    log.error("an A2A request failed", extra={"error": type(exc).__name__, "where": where})
    return InternalError("internal error")


class _Call:
    """One method call: the services, the caller, and where a refusal is reported to the route."""

    def __init__(self, context: ServerCallContext) -> None:
        self.services: Services = context.state["services"]
        self.owner: str = context.state["owner"]
        self.context = context
        self.store = TaskStore(self.services.db.sessionmaker)

    def refused(self, error: Exception) -> Exception:
        mapped = a2a_error(error)
        if isinstance(mapped, RefusedError):
            # The HTTP+JSON route answers it with the service's status and Retry-After.
            self.context.state["request"].state.a2a_refused = mapped.error
        return mapped

    async def run(self, task_id: str) -> RunRecord:
        run = await self.services.runs.get(self.owner, task_id) if is_resource_id(task_id) else None
        if run is None:
            raise TaskNotFoundError()
        return run

    async def context_id(self, run: RunRecord) -> str:
        return (await self.store.context_ids(self.owner, [run.conversation_id]))[run.conversation_id]

    async def task(self, run: RunRecord, *, history_length: int | None = None) -> Task:
        latest = await self.services.runs.get(self.owner, run.id) or run
        pending = (
            await self.services.approvals.pending(run_ids=[latest.id])
            if latest.status in ("running", "waiting")
            else []
        )
        return task_of(latest, await self.context_id(latest), pending, history_length=history_length)


class RunsRequestHandler(RequestHandler):
    """The A2A methods on the service's runs; stateless (everything comes with each call)."""

    # -- tasks -------------------------------------------------------------------------------

    @validate_request_params
    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        call = _Call(context)
        try:
            if params.HasField("history_length") and params.history_length < 0:
                raise InvalidParamsError("historyLength must not be negative")
            run = await call.run(params.id)
            return await call.task(
                run, history_length=params.history_length if params.HasField("history_length") else None
            )
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_list_tasks(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        call = _Call(context)
        try:
            if params.HasField("history_length") and params.history_length < 0:
                raise InvalidParamsError("historyLength must not be negative")
            conversation_id: str | None = None
            if params.context_id:
                conv = await _find_context(call, checked_context_id(params.context_id))
                if conv is None:
                    return ListTasksResponse(next_page_token="", page_size=_page_size(params), total_size=0)
                conversation_id = conv.id
            runs, token, total = await call.store.page(call.owner, params, conversation_id)
            contexts = await call.store.context_ids(call.owner, [r.conversation_id for r in runs])
            waiting = [r.id for r in runs if r.status in ("running", "waiting")]
            pending = await call.services.approvals.pending(run_ids=waiting) if waiting else []
            history = params.history_length if params.HasField("history_length") else None
            tasks = [
                task_of(
                    run,
                    contexts[run.conversation_id],
                    [a for a in pending if a.run_id == run.id],
                    history_length=history,
                )
                for run in runs
            ]
            return ListTasksResponse(
                tasks=tasks, next_page_token=token, page_size=_page_size(params), total_size=total
            )
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task | None:
        call = _Call(context)
        try:
            run = await call.run(params.id)
            if run.status in ENDED:
                raise TaskNotCancelableError(f"the task is {run.status}")
            conv = await call.services.conversations.get(call.owner, run.conversation_id)
            if conv is None:
                raise TaskNotFoundError()
            try:
                # This task's run only: another task of its context may have started meanwhile.
                await call.services.manager.cancel(conv, run_id=run.id)
            except NoActiveRunError:
                raise TaskNotCancelableError("the task has ended") from None
            # The run ends within moments, on whichever worker holds it: answer with that end.
            try:
                async with asyncio.timeout(CANCEL_WAIT_S):
                    async for _ in follow_run(call.services, run, past_waits=True):
                        pass
            except TimeoutError:
                log.warning("a cancelled run has not ended yet", extra={"run_id": run.id})
            return await call.task(run)
        except Exception as exc:
            raise call.refused(exc) from exc

    # -- messages ----------------------------------------------------------------------------

    @validate_request_params
    async def on_message_send(self, params: SendMessageRequest, context: ServerCallContext) -> Task | Message:
        call = _Call(context)
        try:
            step = await _accept(call, params)
            history = (
                params.configuration.history_length
                if params.configuration.HasField("history_length")
                else None
            )
            if step.ends_now or params.configuration.return_immediately:
                return await call.task(step.run, history_length=history)
            # Blocking (the default): until the task ends or waits for a person again.
            async for _ in _events_of(call.services, step.run, after=step.after, stop_at_waiting=True):
                pass
            return await call.task(step.run, history_length=history)
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        call = _Call(context)
        try:
            step = await _accept(call, params)
            if step.ends_now:
                yield await call.task(step.run)
                return
            async for event in _task_stream(
                call, step.run, step.context_id, fresh=step.fresh, stop_at_waiting=True
            ):
                yield event
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        call = _Call(context)
        try:
            run = await call.run(params.id)
            if run.status in ENDED:
                raise UnsupportedOperationError(f"the task is {run.status}: there is nothing to subscribe to")
            context_id = await call.context_id(run)
            async for event in _task_stream(call, run, context_id, fresh=False, stop_at_waiting=False):
                yield event
        except Exception as exc:
            raise call.refused(exc) from exc

    # -- push notification configs (N-06: deliveries through the webhooks' outbox) -----------

    @validate_request_params
    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        call = _Call(context)
        try:
            run = await call.run(params.task_id)
            config = await checked_push_config(call.services, params)
            stored = await call.services.webhooks.push_configs.create(call.owner, run.id, config)
            if stored is None:
                raise TaskNotFoundError()
            return push_config_of(stored)
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        call = _Call(context)
        try:
            run = await call.run(params.task_id)
            stored = (
                await call.services.webhooks.push_configs.get(call.owner, run.id, params.id)
                if is_config_id(params.id)
                else None
            )
            if stored is None:
                raise TaskNotFoundError("push notification config not found")
            return push_config_of(stored)
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        call = _Call(context)
        try:
            run = await call.run(params.task_id)
            stored = await call.services.webhooks.push_configs.list_configs(call.owner, run.id)
            return ListTaskPushNotificationConfigsResponse(configs=[push_config_of(c) for c in stored])
        except Exception as exc:
            raise call.refused(exc) from exc

    @validate_request_params
    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        call = _Call(context)
        try:
            run = await call.run(params.task_id)
            # Idempotent (A2A 3.1.10): deleting a config that is gone is no error.
            if is_config_id(params.id):
                await call.services.webhooks.push_configs.delete(call.owner, run.id, params.id)
        except Exception as exc:
            raise call.refused(exc) from exc

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        raise UnsupportedOperationError("this agent has no extended agent card")


def _page_size(params: ListTasksRequest) -> int:
    return params.page_size if params.HasField("page_size") else DEFAULT_PAGE_SIZE


# -- what a message does -----------------------------------------------------------------------


class _Step:
    """What a message did: the run it concerns, where its stream starts, whether it ends there."""

    def __init__(
        self, run: RunRecord, context_id: str, *, fresh: bool, after: str | None, ends_now: bool = False
    ) -> None:
        self.run = run
        self.context_id = context_id
        self.fresh = fresh
        """A new run: its stream is its whole log, from a snapshot of its start."""
        self.after = after
        self.ends_now = ends_now
        """Nothing more happens until another message (it still waits for a person)."""


async def _find_context(call: _Call, context_id: str) -> ConversationRecord | None:
    """The conversation ``context_id`` names for the caller: a context an A2A client named, or one
    of the caller's conversations by its id (N-03)."""
    found = await call.services.threads.find(call.owner, FACE, context_id)
    if found is None:
        found = await call.services.conversations.get(call.owner, context_id)
    return found


async def _accept(call: _Call, params: SendMessageRequest) -> _Step:
    """Reads the message, checks it, and does what it says: a new run, a follow-up, decisions."""
    if not params.HasField("message"):
        raise InvalidParamsError("message is required")
    message = params.message
    inbound = read_message(message)
    if message.task_id:
        run = await call.run(message.task_id)
        context_id = await call.context_id(run)
        if message.context_id and message.context_id != context_id:
            raise InvalidParamsError(f"contextId does not match task {run.id}'s context ({context_id})")
        return await _on_task(call, run, context_id, inbound, params)
    if inbound.decisions:
        raise InvalidParamsError("a decision goes to the task that waits for it: send it with its taskId")
    return await _new_run(call, params, inbound)


async def _new_run(call: _Call, params: SendMessageRequest, inbound: Inbound) -> _Step:
    services, owner = call.services, call.owner
    message = params.message
    spec = agent_spec(params)
    if spec is not None and spec.client_tools:
        raise InvalidParamsError("metadata.agent.client_tools: an A2A client cannot run tools for the agent")
    push_configs = await _given_push_configs(call, params)
    created = False
    if message.context_id:
        context_id = checked_context_id(message.context_id)
        conv = await _find_context(call, context_id)
        if conv is None:
            agent = checked_agent(services, spec)
            conv, created = await services.threads.open(
                owner, FACE, context_id, title=title_from(inbound.text), agent_config=agent
            )
    else:
        agent = checked_agent(services, spec)
        conv = await services.conversations.create(owner, title_from(inbound.text), agent)
        context_id, created = conv.id, True
    placement = Placement(client_id=message.message_id[:200] or None)
    try:
        run = await services.manager.start_run(
            conv, inbound.text, placement=placement, push_configs=push_configs
        )
    except BaseException:
        if created:  # refused (a full queue, a worker that stops): the new context goes too
            try:
                await services.conversations.delete(owner, conv.id)
            except Exception as exc:
                log.warning("could not remove a context whose run did not start", extra={"error": repr(exc)})
        raise
    return _Step(run, context_id, fresh=True, after=None)


async def _on_task(
    call: _Call, run: RunRecord, context_id: str, inbound: Inbound, params: SendMessageRequest
) -> _Step:
    """A message on an existing task (N-04, N-05): everything checked, then its push config
    stored, then what it says done, to this task's run only (a follow-up meant for a task that
    ended never reaches the next task of its context)."""
    services = call.services
    if run.status in ENDED:
        raise UnsupportedOperationError(f"the task is {run.status}: it takes no more messages")
    conv = await services.conversations.get(call.owner, run.conversation_id)
    if conv is None:
        raise TaskNotFoundError()
    configs = await _given_push_configs(call, params)
    chosen = await _chosen(call, run, inbound.decisions) if inbound.decisions else []
    if not inbound.decisions and run.status in ("running", "waiting"):
        pending = await services.approvals.pending(run_ids=[run.id])
        if pending:
            ids = ", ".join(a.id for a in pending)
            raise InvalidParamsError(
                f"task {run.id} waits for a decision on {ids}: send a data part "
                '{"approval_id", "decision": "approve"|"deny", "reason"?, "tool_args"?}'
            )
    for config in configs:
        await services.webhooks.push_configs.create(call.owner, run.id, config)
    after = await services.events.last_id(conv.id)
    if chosen:
        goes_on = await _decide(call, run, chosen)
        if inbound.text:
            await services.manager.interrupt(conv, inbound.text, run_id=run.id)
        return _Step(run, context_id, fresh=False, after=after, ends_now=not goes_on)
    # A follow-up (API.md interrupt): the run folds it in at its next step.
    await services.manager.interrupt(conv, inbound.text, run_id=run.id)
    return _Step(run, context_id, fresh=False, after=after)


_Chosen = tuple[ApprovalRecord, Decision, dict[str, Any]]


async def _chosen(call: _Call, run: RunRecord, decisions: list[Decision]) -> list[_Chosen]:
    """The run's pending approvals the message decides, each with its decision and the arguments
    that will run; all checked, nothing decided yet."""
    services = call.services
    pending = {a.id: a for a in await services.approvals.pending(run_ids=[run.id])}
    if not pending:
        raise InvalidParamsError(f"task {run.id} waits for no approval")
    chosen = []
    for decision in decisions:
        approval_id = decision.approval_id
        if approval_id is None:
            if len(pending) != 1:
                raise InvalidParamsError(
                    f"task {run.id} waits for {len(pending)} approvals: name one with approval_id"
                )
            approval_id = next(iter(pending))
        approval = pending.get(approval_id)
        if approval is None:
            raise InvalidParamsError(f"no pending approval {approval_id} waits in task {run.id}")
        args = approval.tool_args
        if decision.decision == "approve" and decision.tool_args is not None:
            args = edited_args(services, approval, decision.tool_args)
        chosen.append((approval, decision, args))
    return chosen


async def _decide(call: _Call, run: RunRecord, chosen: list[_Chosen]) -> bool:
    """Decides what ``_chosen`` checked; whether the run goes on."""
    services = call.services
    for approval, decision, args in chosen:
        await decide_approval(
            services,
            approval,
            status="approved" if decision.decision == "approve" else "denied",
            reason=decision.reason,
            args=args,
            decided_by=call.owner,
        )
    left, calls = await services.approvals.waiting_of(run.id)
    return not left and not calls


async def _given_push_configs(call: _Call, params: SendMessageRequest) -> list[NewPushConfig]:
    """The push config sent with a message (``configuration.taskPushNotificationConfig``), checked."""
    if not params.configuration.HasField("task_push_notification_config"):
        return []
    return [await checked_push_config(call.services, params.configuration.task_push_notification_config)]


# -- streams -----------------------------------------------------------------------------------


async def _events_of(
    services: Services, run: RunRecord, *, after: str | None, stop_at_waiting: bool
) -> AsyncIterator[tuple[StoredEvent, bool]]:
    """``follow_run``'s events, each with whether it is a ``waiting`` that still waits (the
    translation needs it); ends after the ``done``, or (``stop_at_waiting``) at a waiting that
    still waits."""
    async for event in follow_run(services, run, after, past_waits=True):
        waits = is_waiting(event) and await still_waits(services, run.id, payload(event))
        yield event, waits
        if waits and stop_at_waiting:
            return


async def _task_stream(
    call: _Call, run: RunRecord, context_id: str, *, fresh: bool, stop_at_waiting: bool
) -> AsyncIterator[Any]:
    """A task's stream: its snapshot, then its events live (N-04, N-05). A new run's snapshot is
    its start; an existing task's is what its stored events say, and the stream goes on after them."""
    services = call.services
    translation = TaskEvents(run.id, context_id)
    first = question(run)
    first.context_id = context_id
    after: str | None = None
    if not fresh:
        stored = await services.events.for_run(run.id)
        for event in stored:
            translation.event(event, waits=False)
        if stored:
            after = stored[-1].id
        # Whether it waits for a person is GetTask's answer, from the run and its approvals now
        # (``task_of``): a run that asked waits from then on, though its row says running until
        # it parks; and a decision may have come since the stored waiting.
        now = await call.task(run)
        if now.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            translation.state = now.status.state
            translation.status_message = now.status.message if now.status.HasField("message") else None
    elif run.status == "running":
        translation.state = TaskState.TASK_STATE_WORKING  # it started at once
    snapshot = translation.snapshot(first)
    translation.caught_up()
    yield snapshot
    if translation.state in TERMINAL:  # it ended between the message and the snapshot
        return
    async for event, waits in _events_of(services, run, after=after, stop_at_waiting=stop_at_waiting):
        for update in translation.event(event, waits=waits):
            yield update

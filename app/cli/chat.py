"""``agentstream chat`` and ``agentstream watch``: start a run and follow its events to ``done``.

Ctrl-C while following asks whether to cancel the run (on a terminal) or detaches (otherwise);
detaching never stops the run, it keeps going on the server and can be followed again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from app.cli.client import ApiClient, ApiError, CliError, StreamFollower
from app.cli.render import Renderer

EXIT_OK = 0
EXIT_RUN_NOT_COMPLETED = 1
EXIT_DETACHED = 130


@dataclass(slots=True)
class Prompt:
    """How to ask the user something; ``interactive`` is False when stdin is not a terminal."""

    interactive: bool
    ask: Callable[[str], str] = field(default=input)

    def confirm(self, question: str) -> bool:
        try:
            return self.ask(question).strip().lower() in {"y", "yes"}
        except (EOFError, KeyboardInterrupt):
            return False


class ChatSession:
    """Follows one conversation's run to its end and renders it; returns a process exit code."""

    def __init__(
        self,
        client: ApiClient,
        renderer: Renderer,
        prompt: Prompt,
        *,
        max_retries: int = 5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client = client
        self._renderer = renderer
        self._prompt = prompt
        self._max_retries = max_retries
        self._sleep = sleep

    def chat(self, question: str, conversation_id: str | None = None, *, model: str | None = None) -> int:
        """Send ``question`` (in a new conversation on ``model`` unless one is given) and follow
        the run."""
        if conversation_id is not None and model is not None:
            raise CliError("--model picks the model of a new conversation; drop --conversation or --model")
        if conversation_id is None:
            conversation = self._client.create_conversation(model=model)
            conversation_id = conversation.get("id") or conversation.get("conversation_id")
            if not isinstance(conversation_id, str):
                raise CliError("the server created a conversation but sent no id")
        return self.start(conversation_id, lambda: self._client.start_run(conversation_id, question))

    def start(
        self, conversation_id: str, start_run: Callable[[], dict[str, Any]], *, note: str | None = None
    ) -> int:
        """Start a run with ``start_run`` (a request answered like ``POST .../runs``: a question,
        an edit, a regenerate) and follow it; ``note`` says what it does."""
        self._renderer.info(f"conversation: {conversation_id}")
        if note:
            self._renderer.info(note)
        try:
            run = start_run()
        except ApiError as exc:
            raise run_active_error(exc, conversation_id) from None
        run_id = run.get("run_id")
        return self.follow(conversation_id, run_id=run_id if isinstance(run_id, str) else None)

    def follow(self, conversation_id: str, *, run_id: str | None = None, after: str | None = None) -> int:
        """Render the conversation's stream until the run's ``done`` (or until the user detaches)."""
        follower = StreamFollower(
            self._client,
            conversation_id,
            after=after,
            run_id=run_id,
            max_retries=self._max_retries,
            sleep=self._sleep,
            on_retry=self._reconnecting,
        )
        cancel_requested = False
        while not follower.finished:
            try:
                with closing(follower.events()) as events:
                    for event in events:
                        self._renderer.handle(event)
                        if event.event == "approval" and event.data.get("status") == "requested":
                            self._ask_approval(conversation_id, event.data)
            except KeyboardInterrupt:
                self._renderer.break_line()
                if cancel_requested or not self._prompt.interactive:
                    return self._detach(conversation_id, follower.cursor)
                if not self._prompt.confirm("Cancel the run? [y/N] "):
                    return self._detach(conversation_id, follower.cursor)
                cancel_requested = True
                self._request_cancel(conversation_id)
        code = self._finish(follower, run_id)
        self._renderer.info(f'continue with: agentstream chat "..." --conversation {conversation_id}')
        return code

    def _finish(self, follower: StreamFollower, run_id: str | None) -> int:
        if follower.done is not None:
            status = follower.done.data.get("status")
        elif run_id is not None:
            # 204 before our ``done`` arrived: the run ended while we were away; show its record.
            run = self._client.get_run(run_id)
            self._renderer.run_summary(run)
            status = run.get("status")
        else:
            self._renderer.info("no run to follow in this conversation")
            return EXIT_OK
        return EXIT_OK if status == "completed" else EXIT_RUN_NOT_COMPLETED

    def _ask_approval(self, conversation_id: str, data: dict[str, Any]) -> None:
        """A call waits for a person (RUNS.md A-07): ask at the prompt, or say how to answer."""
        approval_id = str(data.get("approval_id", ""))
        if not self._prompt.interactive:
            self._renderer.info(
                f"  answer with: agentstream approve {approval_id}"
                f"  |  agentstream deny {approval_id} --reason ..."
            )
            return
        while True:
            try:
                answer = self._prompt.ask("  approve? [y]es / [n]o / [e]dit arguments: ").strip().lower()
            except (EOFError, KeyboardInterrupt):
                self._renderer.info(f"  not decided; answer later with: agentstream approve {approval_id}")
                return
            try:
                if answer in {"y", "yes"}:
                    self._client.decide(conversation_id, approval_id, "approve")
                elif answer in {"n", "no"}:
                    reason = self._prompt.ask("  reason (optional): ").strip()
                    self._client.decide(conversation_id, approval_id, "deny", reason=reason or None)
                elif answer in {"e", "edit"}:
                    edited = json.loads(self._prompt.ask("  arguments as JSON: "))
                    if not isinstance(edited, dict):
                        raise ValueError("the arguments must be a JSON object")
                    self._client.decide(conversation_id, approval_id, "approve", tool_args=edited)
                else:
                    continue
                return
            except (ValueError, EOFError) as exc:
                self._renderer.info(f"  {exc}; try again")
            except ApiError as exc:
                if exc.status == 409:
                    self._renderer.info(f"  {exc.message}")
                    return
                if exc.status != 422:
                    raise
                self._renderer.info(f"  {exc.message}; try again")

    def _request_cancel(self, conversation_id: str) -> None:
        try:
            self._client.cancel(conversation_id)
        except ApiError as exc:
            if exc.code != "no_active_run":
                raise
            self._renderer.info("the run had already finished")
            return
        self._renderer.info("cancel requested; waiting for the run to stop…")

    def _detach(self, conversation_id: str, cursor: str | None) -> int:
        after = f" --after {cursor}" if cursor else ""
        self._renderer.info(
            "detached; the run keeps going on the server.\n"
            f"  follow it:  agentstream watch {conversation_id}{after}\n"
            f"  cancel it:  agentstream cancel {conversation_id}\n"
            f'  continue:   agentstream chat "..." --conversation {conversation_id}'
        )
        return EXIT_DETACHED

    def _reconnecting(self, attempt: int, reason: str) -> None:
        # One quiet reconnect is routine (a server restarting, a proxy closing the stream); saying
        # so would only split the answer being streamed. Repeated failures are worth a note.
        if attempt == 1:
            return
        self._renderer.break_line()
        self._renderer.info(f"· {reason}; reconnecting (attempt {attempt}/{self._max_retries})")


def run_active_error(exc: ApiError, conversation_id: str) -> CliError:
    """A ``409 run_active`` as what to do about it; any other error unchanged."""
    if exc.code != "run_active":
        return exc
    return CliError(
        f"{exc.message}; follow it with `agentstream watch {conversation_id}` "
        f"or stop it with `agentstream cancel {conversation_id}`"
    )

"""The ``agentstream`` command line: the argparse tree, one function per subcommand, and ``main``.

Server-side commands (``serve``, ``migrate``) read ``app.settings.Settings``; client commands talk
HTTP through ``ApiClient``. Every expected failure is a ``CliError`` printed as one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from app.cli import branches
from app.cli.chat import ChatSession, Prompt
from app.cli.client import ApiClient, ApiError, CliError
from app.cli.config import DEFAULT_URL, CliSettings
from app.cli.render import HumanRenderer, JsonRenderer, Renderer

Handler = Callable[[argparse.Namespace], int]

EPILOG = """\
exit codes: 0 success (for chat/watch/edit/regenerate: the run completed), 1 error or a run that
failed or was cancelled, 130 interrupted or detached with Ctrl-C (the run keeps going on the server).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``agentstream`` console script; returns the process exit code."""
    _tolerate_unencodable_output()
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentstream",
        description="Run the AgentStream server, or talk to one: chat with its agent and follow runs live.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--url", help=f"server URL (default: $AGENTSTREAM_URL, else {DEFAULT_URL})", metavar="URL"
    )
    remote.add_argument(
        "--key",
        help="API key (default: $AGENTSTREAM_KEY; prefer the variable, flags are visible to other users)",
        metavar="KEY",
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON (one event per line) instead")

    serve = commands.add_parser(
        "serve",
        help="run the HTTP server (uvicorn)",
        description="Run the server with uvicorn. Several workers share runs only through Redis: "
        "set REDIS_URL when --workers is above 1.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s)")
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="worker processes (default: %(default)s); more than 1 needs REDIS_URL to share runs",
    )
    serve.add_argument("--reload", action="store_true", help="restart on code changes (development)")
    serve.set_defaults(handler=cmd_serve)

    migrate = commands.add_parser("migrate", help="create or upgrade the database schema")
    migrate.add_argument("--url", help="database URL (default: $DATABASE_URL)", metavar="URL")
    migrate.set_defaults(handler=cmd_migrate)

    chat = commands.add_parser(
        "chat",
        parents=[remote, as_json],
        help="ask the agent something and follow its work live",
        description="Start a run and print its events as they arrive. Ctrl-C offers to cancel the run "
        "(or, without a terminal, detaches and leaves it running).",
        epilog=EPILOG,
    )
    chat.add_argument("question", help="what to ask")
    chat.add_argument("--conversation", metavar="ID", help="continue this conversation instead of a new one")
    chat.add_argument(
        "--model",
        metavar="NAME",
        help="the model of a new conversation (see `agentstream models`; default: the server's)",
    )
    chat.add_argument("-v", "--verbose", action="store_true", help="show reasoning and full tool output")
    chat.set_defaults(handler=cmd_chat)

    watch = commands.add_parser(
        "watch",
        parents=[remote, as_json],
        help="follow a conversation's current (or latest) run to its end",
        epilog=EPILOG,
    )
    watch.add_argument("conversation_id", metavar="CONVERSATION_ID")
    watch.add_argument("--after", metavar="CURSOR", help="resume after this event id")
    watch.add_argument("-v", "--verbose", action="store_true", help="show reasoning and full tool output")
    watch.set_defaults(handler=cmd_watch)

    interrupt = commands.add_parser(
        "interrupt", parents=[remote], help="send a message to the agent while it is running"
    )
    interrupt.add_argument("conversation_id", metavar="CONVERSATION_ID")
    interrupt.add_argument("text", help="what to tell the running agent")
    interrupt.set_defaults(handler=cmd_interrupt)

    cancel = commands.add_parser("cancel", parents=[remote], help="stop a conversation's active run")
    cancel.add_argument("conversation_id", metavar="CONVERSATION_ID")
    cancel.set_defaults(handler=cmd_cancel)

    approvals = commands.add_parser(
        "approvals", parents=[remote, as_json], help="list the tool calls that wait for your approval"
    )
    approvals.set_defaults(handler=cmd_approvals)
    approve = commands.add_parser("approve", parents=[remote], help="approve a tool call that waits for you")
    approve.add_argument("approval_id", metavar="APPROVAL_ID")
    approve.add_argument("--args", metavar="JSON", help="run it with these arguments instead (a JSON object)")
    approve.add_argument(
        "--conversation", metavar="CONVERSATION_ID", help="its conversation (found if omitted)"
    )
    approve.set_defaults(handler=cmd_decide, decision="approve")
    deny = commands.add_parser("deny", parents=[remote], help="deny a tool call that waits for you")
    deny.add_argument("approval_id", metavar="APPROVAL_ID")
    deny.add_argument("--reason", metavar="TEXT", help="why (the agent reads it)")
    deny.add_argument("--conversation", metavar="CONVERSATION_ID", help="its conversation (found if omitted)")
    deny.set_defaults(handler=cmd_decide, decision="deny")

    runs = commands.add_parser("runs", parents=[remote, as_json], help="show one run")
    runs.add_argument("run_id", metavar="RUN_ID")
    runs.add_argument("--events", action="store_true", help="print the run's stored events")
    runs.set_defaults(handler=cmd_runs)

    _add_branch_commands(commands, [remote, as_json])

    conversations = commands.add_parser(
        "conversations",
        parents=[remote, as_json],
        help="list your conversations, newest first, or show one",
        description="List your conversations, newest first; with CONVERSATION_ID, show that one's "
        'current branch: each message\'s id, role, "n/m" among its siblings (edits and regenerates '
        "of the same message) with their ids, and the start of its text.",
    )
    conversations.add_argument(
        "conversation_id", nargs="?", metavar="CONVERSATION_ID", help="show this conversation's messages"
    )
    conversations.add_argument("--limit", type=_positive_int, metavar="N", help="at most N conversations")
    conversations.add_argument("--cursor", metavar="CURSOR", help="continue a previous listing")
    conversations.set_defaults(handler=cmd_conversations)

    models = commands.add_parser("models", parents=[remote, as_json], help="list the models agents can use")
    models.set_defaults(handler=cmd_models)
    return parser


def _add_branch_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], parents: list[argparse.ArgumentParser]
) -> None:
    """``edit``, ``regenerate``, ``fork``, ``switch`` (FACES.md B-09); ``app.cli.branches`` does them."""
    ids = "message ids: `agentstream conversations CONVERSATION_ID`"
    edit = commands.add_parser(
        "edit",
        parents=parents,
        help="change a question and follow the new answer",
        usage="agentstream edit [-h] [--url URL] [--key KEY] [--json] [-v] "
        "CONVERSATION_ID [MESSAGE_ID] TEXT...",
        description="Ask TEXT in place of a question (MESSAGE_ID; default: the last question of the "
        "current branch) and follow the run like `chat`. The new question goes beside the old one, "
        f"which stays reachable with `agentstream switch`; {ids}.",
        epilog=EPILOG,
    )
    edit.add_argument("conversation_id", metavar="CONVERSATION_ID")
    edit.add_argument(
        "words",
        nargs="+",
        metavar="TEXT",
        help="the new question, after the id of the question to change if not the last (msg_<n>)",
    )
    regenerate = commands.add_parser(
        "regenerate",
        parents=parents,
        help="answer a question again and follow the new answer",
        description="A new answer beside an answer (MESSAGE_ID; default: the last answer of the current "
        "branch, or its last question when its run ended without one), or a question (a user message) "
        f"answered again; the run is followed like `chat`'s; {ids}.",
        epilog=EPILOG,
    )
    regenerate.add_argument("conversation_id", metavar="CONVERSATION_ID")
    regenerate.add_argument("message_id", nargs="?", type=_message_id, metavar="MESSAGE_ID")
    for command, handler in ((edit, cmd_edit), (regenerate, cmd_regenerate)):
        command.add_argument(
            "-v", "--verbose", action="store_true", help="show reasoning and full tool output"
        )
        command.set_defaults(handler=handler)

    fork = commands.add_parser(
        "fork",
        parents=parents,
        help="start a new conversation from the path to a message",
        description="A new conversation (same agent settings) whose messages are copies of the path to "
        f"MESSAGE_ID (default: the current leaf); the original does not change; {ids}.",
    )
    fork.add_argument("conversation_id", metavar="CONVERSATION_ID")
    fork.add_argument("message_id", nargs="?", type=_message_id, metavar="MESSAGE_ID")
    fork.add_argument("--title", metavar="TEXT", help='its title (default: "<the original\'s> (fork)")')
    fork.set_defaults(handler=cmd_fork)

    switch = commands.add_parser(
        "switch",
        parents=parents,
        help="make another branch of a conversation the current one",
        description="The newest leaf below MESSAGE_ID (an edited question, a regenerated answer) becomes "
        f"the current leaf; shows the branch then; {ids}.",
    )
    switch.add_argument("conversation_id", metavar="CONVERSATION_ID")
    switch.add_argument("message_id", type=_message_id, metavar="MESSAGE_ID")
    switch.set_defaults(handler=cmd_switch)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    settings = _server_settings()
    if args.reload and args.workers > 1:
        raise CliError("--reload runs a single process; drop --workers or --reload")
    if args.workers > 1 and settings.redis_url is None:
        print(
            f"warning: {args.workers} workers without REDIS_URL: each worker has its own event bus, so a "
            "run is only visible through the worker that started it. Set REDIS_URL to share runs.",
            file=sys.stderr,
        )
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        reload=args.reload,
    )
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    url: str = args.url or _server_settings().database_url
    try:
        from app.db.migrate import upgrade_database
    except ImportError as exc:
        raise CliError(f"database migrations are not available in this installation ({exc})") from None
    try:
        upgrade_database(url)
    except Exception as exc:
        raise CliError(f"migrating {_without_password(url)} failed: {type(exc).__name__}: {exc}") from None
    print(f"database is up to date: {_without_password(url)}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _session(args, client).chat(args.question, args.conversation, model=args.model)


def cmd_watch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _session(args, client).follow(args.conversation_id, after=args.after)


def cmd_edit(args: argparse.Namespace) -> int:
    message_id, text = branches.edit_words(args.words)
    with _client(args) as client:
        return branches.edit(client, _session(args, client), args.conversation_id, message_id, text)


def cmd_regenerate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return branches.regenerate(client, _session(args, client), args.conversation_id, args.message_id)


def cmd_fork(args: argparse.Namespace) -> int:
    with _client(args) as client:
        forked = branches.fork(client, args.conversation_id, args.message_id, args.title)
    if args.json:
        print(json.dumps(forked, indent=2, ensure_ascii=False))
        return 0
    print(f"{forked.get('id', '?')}  {forked.get('title') or '(untitled)'}")
    print(f'continue with: agentstream chat "..." --conversation {forked.get("id", "?")}')
    return 0


def cmd_switch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        detail = branches.switch(client, args.conversation_id, args.message_id)
    _print_conversation(args, detail)
    return 0


def cmd_interrupt(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            body = client.interrupt(args.conversation_id, args.text)
        except ApiError as exc:
            raise _no_active_run(exc, args.conversation_id, "interrupt") from None
    queued = body.get("queued")
    print(f"queued for the running agent ({queued} waiting)" if queued is not None else "queued")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            client.cancel(args.conversation_id)
        except ApiError as exc:
            raise _no_active_run(exc, args.conversation_id, "cancel") from None
    print(f"cancel requested for conversation {args.conversation_id}")
    return 0


def cmd_approvals(args: argparse.Namespace) -> int:
    with _client(args) as client:
        items = client.pending_approvals()
    if args.json:
        for item in items:
            print(json.dumps(item, ensure_ascii=False))
        return 0
    if not items:
        print("nothing waits for your approval")
    for item in items:
        args_text = json.dumps(item.get("tool_args", {}), ensure_ascii=False)
        print(f"{item.get('approval_id')}  {item.get('tool_name')} {args_text}")
        print(f"    conversation {item.get('conversation_id')}, expires {item.get('expires_at')}")
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    tool_args = None
    if getattr(args, "args", None):
        try:
            tool_args = json.loads(args.args)
        except ValueError as exc:
            raise CliError(f"--args is not JSON: {exc}") from None
        if not isinstance(tool_args, dict):
            raise CliError("--args must be a JSON object")
    with _client(args) as client:
        conversation_id = args.conversation
        if conversation_id is None:
            found = [a for a in client.pending_approvals() if a.get("approval_id") == args.approval_id]
            if not found:
                raise CliError(
                    f"no pending approval {args.approval_id} of yours (decided already? "
                    "see `agentstream approvals`)"
                )
            conversation_id = str(found[0]["conversation_id"])
        body = client.decide(
            conversation_id,
            args.approval_id,
            args.decision,
            reason=getattr(args, "reason", None),
            tool_args=tool_args,
        )
    print(f"{body.get('status')}: {args.approval_id} (run {body.get('run_id')})")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.events:
            renderer = _renderer(args)
            for event in client.run_events(args.run_id):
                renderer.handle(event)
            renderer.break_line()
            return 0
        run = client.get_run(args.run_id)
    if args.json:
        print(json.dumps(run, indent=2, ensure_ascii=False))
    else:
        print(format_run(run))
    return 0


def cmd_conversations(args: argparse.Namespace) -> int:
    if args.conversation_id is not None:
        if args.limit is not None or args.cursor is not None:
            raise CliError("--limit and --cursor page the list of conversations, not one conversation")
        with _client(args) as client:
            _print_conversation(args, client.get_conversation(args.conversation_id))
        return 0
    with _client(args) as client:
        page = client.list_conversations(limit=args.limit, cursor=args.cursor)
    if args.json:
        print(json.dumps(page, indent=2, ensure_ascii=False))
        return 0
    items = [item for item in page.get("items") or () if isinstance(item, dict)]
    if not items:
        print("no conversations")
    for item in items:
        active = f"  [running {item['active_run_id']}]" if item.get("active_run_id") else ""
        when = item.get("updated_at") or item.get("created_at") or ""
        print(f"{item.get('id', '?')}  {when}  {item.get('title') or '(untitled)'}{active}")
    if page.get("next_cursor"):
        print(f"more: agentstream conversations --cursor {page['next_cursor']}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models = client.list_models()
    if args.json:
        print(json.dumps(models, indent=2, ensure_ascii=False))
        return 0
    for item in models:
        abilities = ",".join(name for name, on in (item.get("abilities") or {}).items() if on)
        default = "  (default)" if item.get("default") else ""
        print(f"{item.get('name', '?')}  {item.get('model', '?')}  {abilities}{default}")
    return 0


def format_run(run: dict[str, Any]) -> str:
    """A run record (``GET /api/runs/{id}``) as aligned ``field  value`` lines, answer last."""
    usage = run.get("usage") if isinstance(run.get("usage"), dict) else None
    rows: list[tuple[str, object]] = [
        ("run", run.get("run_id")),
        ("conversation", run.get("conversation_id")),
        ("status", run.get("status")),
        ("iterations", run.get("iterations")),
    ]
    if usage:
        rows.append(
            (
                "tokens",
                f"{usage.get('total_tokens', 0)} ({usage.get('prompt_tokens', 0)} in, "
                f"{usage.get('completion_tokens', 0)} out) in {usage.get('llm_calls', 0)} LLM calls",
            )
        )
    elapsed = run.get("elapsed")
    rows += [
        ("elapsed", f"{elapsed:.2f}s" if isinstance(elapsed, int | float) else elapsed),
        ("created", run.get("created_at")),
        ("finished", run.get("finished_at")),
        ("error", run.get("error")),
    ]
    lines = [f"{name:<13}{value}" for name, value in rows if value not in (None, "")]
    if run.get("answer"):
        lines += ["", str(run["answer"])]
    return "\n".join(lines)


def _client(args: argparse.Namespace) -> ApiClient:
    settings = CliSettings()
    key = args.key or (settings.agentstream_key.get_secret_value() if settings.agentstream_key else None)
    return ApiClient(args.url or settings.agentstream_url, key)


def _print_conversation(args: argparse.Namespace, detail: dict[str, Any]) -> None:
    print(
        json.dumps(detail, indent=2, ensure_ascii=False)
        if args.json
        else branches.format_conversation(detail)
    )


def _session(args: argparse.Namespace, client: ApiClient) -> ChatSession:
    return ChatSession(client, _renderer(args), Prompt(interactive=sys.stdin.isatty()))


def _renderer(args: argparse.Namespace) -> Renderer:
    if args.json:
        return JsonRenderer(sys.stdout, sys.stderr)
    return HumanRenderer(sys.stdout, verbose=getattr(args, "verbose", False))


def _no_active_run(exc: ApiError, conversation_id: str, action: str) -> CliError:
    if exc.status != 409:
        return exc
    return CliError(
        f"no run is active in conversation {conversation_id}, so there is nothing to {action}; "
        f'start one with `agentstream chat "..." --conversation {conversation_id}`'
    )


def _server_settings() -> Any:
    from pydantic import ValidationError

    from app.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        raise CliError(f"invalid configuration:\n{exc}") from None


def _without_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "the database"


def _tolerate_unencodable_output() -> None:
    # The arrows and ticks of the output must not crash a terminal with a narrow encoding.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def _message_id(text: str) -> str:
    if not branches.is_message_id(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a message id: they look like msg_12")
    return text


def _positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _port(text: str) -> int:
    value = _whole_number(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError("must be between 1 and 65535")
    return value


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None

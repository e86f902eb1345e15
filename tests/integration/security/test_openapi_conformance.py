"""The HTTP API against its own OpenAPI document, with schemathesis.

Every operation gets a few dozen generated requests, valid and invalid, with API keys set (so auth
is exercised: the checks also send requests without the key and expect 401). The app runs in this
process through schemathesis's ASGI transport, with its lifespan (database, bus, demo model); runs
it starts finish in the background on the transport's event loop.

Checks: no 5xx; status code, content type and body schema as documented; invalid data rejected and
valid data accepted. Nothing is excluded. Generated ids name nothing, so some cases are pointed at
real ids: the caller's (alice) and another owner's (bob), which must be 404 like any unknown id.
Three facts JSON Schema cannot carry are made true of the *valid* cases only, so that
"valid data is accepted" tests something: an agent's ``tools`` must be registered tool names, a
list ``cursor`` must be one the service handed out, and a run's ``webhook`` a URL the service posts
to (a loopback one here: nothing is ever resolved or sent off this machine).
``POST /v1/chat/completions`` takes OpenAI's request schema, which allows more than an agent can
take (tool messages, images, a last message that is not the user's); those valid-by-schema requests
are refused with a documented 4xx, so the "valid data is accepted" check alone is not run on that
operation. The same holds of the protocol faces' requests, whose schemas are the protocols'
(FACES.md): a message list that ends with neither a new question nor a waiting run's message,
messages without text.
"""

from __future__ import annotations

import shutil
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import APIOperation, BaseSchema, Case, GenerationMode
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import positive_data_acceptance

from app.main import create_app
from app.settings import Settings

ALICE_KEY = "fuzz-alice-key"
ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB = {"Authorization": "Bearer fuzz-bob-key"}
KEYS = f"alice:{ALICE_KEY},bob:fuzz-bob-key"
PROTOCOL_BODIES = ("POST /v1/chat/completions", "POST /api/ai-sdk/chat", "POST /api/ag-ui")
DISPOSABLE = 8
WEBHOOK = "http://127.0.0.1:9/hook"
"""A webhook URL the subject takes (port 9: nothing answers there, the deliveries just fail)."""
EXAMPLES = 12
"""Per operation and mode (valid, invalid): about 700 requests in all, a test per operation."""


@dataclass
class Known:
    """Real ids the generated requests are sometimes pointed at."""

    conversations: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    disposable: list[str] = field(default_factory=list)
    cursors: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    bobs: set[str] = field(default_factory=set)


@dataclass
class Subject:
    app: FastAPI
    known: Known


def _seed(app: FastAPI) -> Known:
    """Conversations with a run each, for alice and for bob; a list cursor; the tool names."""
    known = Known()
    with asgi.get_client(app) as client:
        known.tools = [t["name"] for t in client.get("/api/tools", headers=ALICE).json()]
        for headers in (ALICE, BOB):
            for title in ("first", "second"):
                conv = client.post("/api/conversations", json={"title": title}, headers=headers).json()
                run = client.post(
                    f"/api/conversations/{conv['id']}/runs", json={"message": "What is 6*7?"}, headers=headers
                ).json()
                known.conversations.append(conv["id"])
                known.runs.append(run["run_id"])
                if headers is BOB:
                    known.bobs.update((conv["id"], run["run_id"]))
        for _ in range(DISPOSABLE):
            known.disposable.append(client.post("/api/conversations", headers=ALICE).json()["id"])
        page = client.get("/api/conversations", params={"limit": 1}, headers=ALICE).json()
        known.cursors.append(page["next_cursor"])
    return known


def _settings(database_url: str) -> Settings:
    return Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=database_url,
        redis_url=None,
        api_keys=KEYS,
        llm_base_url=None,
        demo_delay_s=0,
        shutdown_grace_s=0,
        sse_ping_seconds=1,
        log_level="CRITICAL",
        webhook_allow_private=True,
        webhook_allowed_hosts="127.0.0.1",
    )


@pytest.fixture(scope="module")
def subject(sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subject]:
    path = tmp_path_factory.mktemp("openapi") / "agentstream.db"
    shutil.copyfile(sqlite_migrated_template, path)
    app = create_app(_settings(f"sqlite+aiosqlite:///{path}"))
    try:
        yield Subject(app, _seed(app))
    finally:
        asgi.shutdown_lifespans()


def _point_at_known_ids(case: Case, known: Known, data: st.DataObject) -> None:
    params = case.path_parameters or {}
    if "conversation_id" in params:
        pool = known.disposable if case.method == "DELETE" else known.conversations
        params["conversation_id"] = data.draw(st.sampled_from([params["conversation_id"], *pool]))
    if "run_id" in params:
        params["run_id"] = data.draw(st.sampled_from([params["run_id"], *known.runs]))


def _make_semantically_valid(case: Case, known: Known, data: st.DataObject) -> None:
    """What a schema cannot say, made true of the valid cases (see the module docstring)."""
    agent = case.body.get("agent") if isinstance(case.body, dict) else None
    if isinstance(agent, dict) and isinstance(agent.get("tools"), list):
        agent["tools"] = data.draw(st.lists(st.sampled_from(known.tools), max_size=len(agent["tools"])))
    if isinstance(case.body, dict) and isinstance(case.body.get("webhook"), str):
        case.body["webhook"] = WEBHOOK
    if isinstance(case.query, dict) and "cursor" in case.query:
        case.query["cursor"] = data.draw(st.sampled_from(known.cursors))


def _exercise(operation: APIOperation, mode: GenerationMode, known: Known) -> int:
    """Send ``EXAMPLES`` generated requests to one operation; returns how many were sent."""
    sent = 0
    excluded = [positive_data_acceptance] if operation.label in PROTOCOL_BODIES else []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def exercise(case: Case, data: st.DataObject) -> None:
        nonlocal sent
        _point_at_known_ids(case, known, data)
        if mode is GenerationMode.POSITIVE:
            _make_semantically_valid(case, known, data)
        sent += 1
        response = case.call_and_validate(excluded_checks=excluded)
        if set((case.path_parameters or {}).values()) & known.bobs:
            # Invalid cases may also have lost the key (401) or their body (4xx): never a success.
            if mode is GenerationMode.POSITIVE:
                assert response.status_code == 404, f"another owner's id answered {response.status_code}"
            assert response.status_code >= 400, f"another owner's id answered {response.status_code}"

    exercise()
    return sent


def _operations() -> list[str]:
    """Every operation of the document, labelled as schemathesis labels them (``GET /api/tools``):
    a test each, which the test workers share (tests/support/scheduling.py)."""
    document = create_app(_settings("sqlite+aiosqlite://")).openapi()
    return [f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item]


OPERATIONS = _operations()


@pytest.fixture(scope="module")
def schema(subject: Subject) -> BaseSchema:
    # Alice's key goes through the document's own security scheme, so invalid cases can drop it.
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"HTTPBearer": {"bearer": ALICE_KEY}}}})
    return schemathesis.openapi.from_asgi("/openapi.json", subject.app, config=config)


def test_every_operation_the_service_documents_has_its_test(schema: BaseSchema) -> None:
    served = [result.ok().label for result in schema.get_all_operations()]
    assert served == OPERATIONS
    assert len(served) >= 18 and "POST /v1/chat/completions" in served


@pytest.mark.slow
@pytest.mark.timeout(90)  # the longest (POST runs) takes some 10 s alone, 30 s in a busy full run
@pytest.mark.parametrize("label", OPERATIONS)
def test_the_operation_answers_as_documented_and_never_with_a_5xx(
    label: str, schema: BaseSchema, subject: Subject
) -> None:
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    failures: list[str] = []
    sent = 0
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        try:
            sent += _exercise(operation, mode, subject.known)
        except Unsatisfiable:
            # No parameters, no body: nothing can be made invalid (a missing key is 401 in the
            # valid cases' checks).
            assert mode is GenerationMode.NEGATIVE and not operation.path_parameters, operation.label
        except BaseException as exc:  # a failure group: schemathesis's report of what went wrong
            if isinstance(exc, KeyboardInterrupt):
                raise
            report = "".join(traceback.format_exception(exc))[-4000:]
            failures.append(f"{operation.label} ({mode.value}):\n{report}")

    assert not failures, "\n\n".join(failures)
    # EXAMPLES valid and EXAMPLES invalid requests; an operation that takes nothing has one request.
    takes_input = any((operation.path_parameters, operation.query, operation.headers, operation.body))
    assert sent >= (2 * EXAMPLES if takes_input else 1), sent

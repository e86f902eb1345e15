"""Full runs through the service against each family of real providers (issue 15).

Each family is a fake from ``tests.support.fake_providers`` that speaks the provider's real wire
shapes and refuses what the provider refuses, behind the real openai client over a socket. The
runs that only read what happened share one service per family (``scenarios``): each (family,
mode) runs once, in a conversation of that mode (``agent.mode``: native function calling, or
JSON mode), and the tests read its events. Tests that need settings or replies of their own start
their own service.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.integration.service.conftest import RunOutcome, Service, ServiceFactory
from tests.support.fake_openai import FakeOpenAIServer
from tests.support.fake_providers import (
    AzureOldApiVersion,
    DeepSeekThinking,
    GeminiOpenAI,
    GroqChat,
    LlamaCppServer,
    MistralChat,
    OpenRouterChat,
    ProviderAgent,
    QuirkyGateway,
    ThinkTagServer,
)
from tests.support.fake_replies import FakeReply
from tests.support.server import ServerThread

QUESTION = "What is 6*7?"
ANSWER = "The answer is 42."
NEXT_QUESTION = "What is 6*7+1?"
NEXT_ANSWER = "The answer is 43."
MODES = ["native", "json"]
_NINE = re.compile(r"[A-Za-z0-9]{9}")


@dataclass(frozen=True)
class Family:
    make: Callable[[], ProviderAgent]
    settings: dict[str, Any]


R1_DISTILL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
FAMILIES: dict[str, Family] = {
    "deepseek": Family(DeepSeekThinking, {"llm_provider": "deepseek", "llm_model": "deepseek-reasoner"}),
    "gemini": Family(GeminiOpenAI, {"llm_provider": "gemini", "llm_model": "gemini-3-pro-preview"}),
    "magistral": Family(
        lambda: MistralChat(magistral=True),
        {"llm_provider": "mistral", "llm_model": "magistral-medium-latest"},
    ),
    # No provider named: a Mistral model keeps Mistral's rules behind any base URL.
    "mistral-behind-a-gateway": Family(
        lambda: MistralChat(ids="gateway", model="mistral-small-latest"),
        {"llm_model": "mistral-small-latest"},
    ),
    "qwen3-on-vllm": Family(
        lambda: ThinkTagServer(continuous_usage=True), {"llm_provider": "vllm", "llm_model": "Qwen/Qwen3-32B"}
    ),
    "r1-distill-on-sglang": Family(
        lambda: ThinkTagServer(model=R1_DISTILL, opened=True),
        {"llm_provider": "sglang", "llm_model": R1_DISTILL},
    ),
    "openrouter": Family(OpenRouterChat, {"llm_provider": "openrouter", "llm_model": "openai/gpt-oss-120b"}),
    "groq": Family(GroqChat, {"llm_provider": "groq", "llm_model": "llama-3.3-70b-versatile"}),
    "azure-2024-02-01": Family(AzureOldApiVersion, {"llm_provider": "azure", "llm_model": "gpt-4o"}),
    "gateway-split-choices": Family(lambda: QuirkyGateway({"split_choices"}), {}),
    "gateway-lone-index-1": Family(lambda: QuirkyGateway({"lone_index_1"}), {}),
    "gateway-stop-beside-calls": Family(lambda: QuirkyGateway({"stop_beside_calls"}), {}),
}
THINKING = ["deepseek", "magistral", "qwen3-on-vllm", "r1-distill-on-sglang", "openrouter"]
THINK_TAGS = ["qwen3-on-vllm", "r1-distill-on-sglang"]


# -- reading a run ------------------------------------------------------------------------------


def streamed_answer(outcome: RunOutcome) -> list[str]:
    return [e.data["content"] for e in outcome.events if e.event == "answer" and e.data["status"] == "delta"]


def step_reasonings(outcome: RunOutcome) -> list[str]:
    return [
        e.data["reasoning"]
        for e in outcome.events
        if e.event == "step" and e.data["type"] == "thinking" and e.data["status"] == "done"
    ]


def tool_steps(outcome: RunOutcome) -> list[tuple[str, str, str | None]]:
    return [
        (e.data["tool_name"], e.data["observation"], e.data["error"])
        for e in outcome.events
        if e.event == "step" and e.data["type"] == "iteration" and e.data["status"] == "done"
    ]


def usage_sum(reported: list[dict[str, int]], llm_calls: int) -> dict[str, int]:
    names = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {**{n: sum(u[n] for u in reported) for n in names}, "llm_calls": llm_calls}


# -- one service per family, one run per (family, mode) -----------------------------------------


@dataclass
class Scenario:
    """One run of ``QUESTION`` in a conversation of one mode, and what the provider saw of it."""

    fake: ProviderAgent
    server: FakeOpenAIServer
    outcome: RunOutcome
    requests: list[dict[str, Any]]
    reported: list[dict[str, int]]
    thoughts: list[str]


@dataclass
class _FamilyService:
    fake: ProviderAgent
    server: FakeOpenAIServer
    service: Service


@dataclass
class Scenarios:
    template: Path
    tmp: pytest.TempPathFactory
    _services: dict[str, _FamilyService] = field(default_factory=dict)
    _runs: dict[tuple[str, str], Scenario] = field(default_factory=dict)

    def get(self, family: str, mode: str) -> Scenario:
        if (family, mode) not in self._runs:
            self._runs[family, mode] = self._run(self._service(family), mode)
        return self._runs[family, mode]

    def _service(self, family: str) -> _FamilyService:
        if family not in self._services:
            spec = FAMILIES[family]
            fake = spec.make()
            server = FakeOpenAIServer().start()
            server.set_handler(fake)
            path = self.tmp.mktemp(f"providers-{family}") / "agentstream.db"
            shutil.copyfile(self.template, path)
            values: dict[str, Any] = {
                "database_url": f"sqlite+aiosqlite:///{path}",
                "llm_base_url": server.base_url,
                "llm_api_key": "sk-provider-test",
                "llm_max_retries": 0,
                "shutdown_grace_s": 0,
                "log_level": "WARNING",
                **spec.settings,
            }
            settings = Settings(_env_file=None, **values)  # type: ignore[call-arg]
            try:
                service = Service(ServerThread(settings).start(), settings, server)
            except BaseException:
                server.stop()
                raise
            self._services[family] = _FamilyService(fake, server, service)
        return self._services[family]

    @staticmethod
    def _run(family: _FamilyService, mode: str) -> Scenario:
        fake, server = family.fake, family.server
        api = family.service.api()
        conversation = api.create_conversation({"agent": {"mode": mode}})
        requests, reported, thoughts = len(server.requests), len(fake.reported), len(fake.thoughts)
        outcome = api.run(conversation["id"], QUESTION)
        server.assert_done()  # the fake understood every request
        return Scenario(
            fake,
            server,
            outcome,
            server.requests[requests:],
            fake.reported[reported:],
            fake.thoughts[thoughts:],
        )

    def close(self) -> None:
        for family in self._services.values():
            family.service.stop()
            family.server.stop()


@pytest.fixture(scope="module")
def scenarios(
    sqlite_migrated_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scenarios]:
    book = Scenarios(sqlite_migrated_template, tmp_path_factory)
    try:
        yield book
    finally:
        book.close()


@pytest.fixture
def database_backend() -> str:
    """The tests with a service of their own run on SQLite unless they say otherwise."""
    return "sqlite"


# -- every family, both modes -------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_run_completes_with_the_answer_from_the_tool_result(
    scenarios: Scenarios, family: str, mode: str
) -> None:
    scenario = scenarios.get(family, mode)

    done = scenario.outcome.done
    assert (done["status"], done["error"], done["answer"]) == ("completed", None, ANSWER)
    assert tool_steps(scenario.outcome) == [("calculator", "6*7 = 42", None)]
    assert "".join(streamed_answer(scenario.outcome)) == ANSWER


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", THINKING)
def test_no_thinking_reaches_the_streamed_answer(scenarios: Scenarios, family: str, mode: str) -> None:
    scenario = scenarios.get(family, mode)

    deltas = streamed_answer(scenario.outcome)
    assert len(scenario.thoughts) == 3, "the provider thought before each reply, synthesis included"
    assert "".join(deltas) == scenario.outcome.done["answer"] == ANSWER
    for shown in [*deltas, scenario.outcome.done["answer"]]:
        assert "think>" not in shown
        assert not any(thought in shown for thought in scenario.thoughts)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", THINKING)
def test_each_steps_reasoning_is_the_thinking_of_its_reply(
    scenarios: Scenarios, family: str, mode: str
) -> None:
    scenario = scenarios.get(family, mode)

    # One thought per loop reply (the tool call, then the answer), then synthesis's own.
    assert step_reasonings(scenario.outcome) == scenario.thoughts[:2]


@pytest.mark.parametrize("family", THINK_TAGS)
def test_json_mode_never_takes_the_draft_action_in_the_thinking_for_the_action(
    scenarios: Scenarios, family: str
) -> None:
    scenario = scenarios.get(family, "json")

    assert '"About 40."' in scenario.thoughts[0], "the first reply's thinking drafts a final answer"
    started = [
        (e.data["tool_name"], e.data["tool_args"])
        for e in scenario.outcome.events
        if e.event == "step" and e.data["type"] == "iteration" and e.data["status"] == "start"
    ]
    assert started == [("calculator", {"expression": "6*7"})]
    assert scenario.outcome.done["answer"] == ANSWER


@pytest.mark.parametrize("family", ["groq", "qwen3-on-vllm", "deepseek", "magistral", "azure-2024-02-01"])
def test_done_usage_adds_up_what_the_provider_reported_once_per_call(
    scenarios: Scenarios, family: str
) -> None:
    # groq: only in x_groq.usage; vLLM: cumulative on every chunk; DeepSeek and Mistral: on the
    # finish chunk; an old Azure API version: none in streams.
    scenario = scenarios.get(family, "native")

    assert len(scenario.reported) >= 2
    expected = usage_sum(scenario.reported, llm_calls=len(scenario.requests))
    assert scenario.outcome.done["usage"] == expected


def test_an_old_azure_api_version_gets_the_stream_again_without_stream_options(scenarios: Scenarios) -> None:
    # Both runs of the family's service: the first stream is refused and asked again without the
    # option; the client remembers, and the next run's stream goes without it at once.
    native = scenarios.get("azure-2024-02-01", "native")
    json_mode = scenarios.get("azure-2024-02-01", "json")

    streams = [body for body in native.server.requests if body.get("stream")]
    assert ["stream_options" in body for body in streams] == [True, False, False]
    assert native.fake.refusals == streams[:1]
    assert native.outcome.done["answer"] == json_mode.outcome.done["answer"] == ANSWER


# -- history sent back ----------------------------------------------------------------------------


def _first_call_message(messages: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first assistant message with tool calls in a request, and the tool result after it."""
    index = next(i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls"))
    result = next(m for m in messages[index:] if m["role"] == "tool")
    return messages[index], result


def _deepseek_gets_the_reasoning_back(
    fake: ProviderAgent, call: dict[str, Any], result: dict[str, Any]
) -> None:
    assert isinstance(fake, DeepSeekThinking)
    served_id = call["tool_calls"][0]["id"]
    assert call["reasoning_content"] == fake.reasoning_of_call[served_id]


def _gemini_gets_the_signature_back(
    fake: ProviderAgent, call: dict[str, Any], result: dict[str, Any]
) -> None:
    assert isinstance(fake, GeminiOpenAI)
    sent = call["tool_calls"][0]
    # Gemini itself validates only the current turn: an earlier run's call is checked here.
    assert sent["extra_content"] == {"google": {"thought_signature": fake.signature_of_call[sent["id"]]}}


def _mistral_gets_nine_character_ids(
    fake: ProviderAgent, call: dict[str, Any], result: dict[str, Any]
) -> None:
    sent_id = call["tool_calls"][0]["id"]
    assert _NINE.fullmatch(sent_id) and sent_id not in fake.served_ids
    assert result["tool_call_id"] == sent_id


HISTORY_CHECKS: dict[str, Callable[[ProviderAgent, dict[str, Any], dict[str, Any]], None]] = {
    "deepseek": _deepseek_gets_the_reasoning_back,
    "gemini": _gemini_gets_the_signature_back,
    "mistral-behind-a-gateway": _mistral_gets_nine_character_ids,
}


@pytest.mark.parametrize("database_backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
@pytest.mark.parametrize("family", list(HISTORY_CHECKS))
def test_a_second_run_sends_the_stored_tool_calls_back_as_the_provider_needs_them(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, family: str, database_backend: str
) -> None:
    fake = FAMILIES[family].make()
    fake_llm.set_handler(fake)
    api = service(llm=fake_llm, **FAMILIES[family].settings).api()
    conversation = api.create_conversation()["id"]
    first = api.run(conversation, QUESTION)
    requests_of_first = len(fake_llm.requests)

    second = api.run(conversation, NEXT_QUESTION)

    fake_llm.assert_done()
    assert first.done["answer"] == ANSWER
    assert (second.done["status"], second.done["error"], second.done["answer"]) == (
        "completed",
        None,
        NEXT_ANSWER,
    )
    assert fake.refusals == []
    history = fake_llm.requests[requests_of_first]["messages"]
    assert history[-1] == {"role": "user", "content": NEXT_QUESTION}
    call, result = _first_call_message(history)
    HISTORY_CHECKS[family](fake, call, result)


@pytest.mark.parametrize("family", list(HISTORY_CHECKS))
def test_a_run_carried_on_from_its_checkpoint_sends_its_tool_calls_back_as_the_provider_needs_them(
    service: ServiceFactory, fake_llm: FakeOpenAIServer, family: str
) -> None:
    fake = FAMILIES[family].make()
    release = threading.Event()

    def hold_the_second_call(body: dict[str, Any]) -> FakeReply:
        reply = fake(body)
        return FakeReply.blocked(release, reply) if len(fake_llm.requests) == 2 else reply

    fake_llm.set_handler(hold_the_second_call)
    settings = {**FAMILIES[family].settings, "run_lease_s": 1.0}
    leaving = service(llm=fake_llm, **settings)
    conversation = leaving.api().create_conversation()["id"]
    leaving.api().start_run(conversation, QUESTION)
    try:
        fake_llm.wait_for_requests(2)
        leaving.stop()  # in the call after the tool's result: the run is handed over
    finally:
        release.set()
    events = service(llm=fake_llm, **settings).api().stream(conversation)

    resumed = [e.data["attempt"] for e in events if e.event == "phase" and e.data["phase"] == "resumed"]
    assert resumed == [2]
    assert (events[-1].data["status"], events[-1].data["answer"]) == ("completed", ANSWER)
    assert fake.refusals == []
    # The new attempt's first call: its history is the checkpoint's.
    call, result = _first_call_message(fake_llm.requests[2]["messages"])
    HISTORY_CHECKS[family](fake, call, result)


# -- Mistral's role order -------------------------------------------------------------------------


def _after_tool_result(body: dict[str, Any], user_text: str) -> list[str]:
    """The roles of the two messages before the user message containing ``user_text``."""
    messages = body["messages"]
    index = next(i for i, m in enumerate(messages) if m["role"] == "user" and user_text in str(m["content"]))
    return [m["role"] for m in messages[index - 2 : index]]


def test_a_reflection_after_tool_results_reaches_mistral_in_an_order_it_accepts(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    mistral = MistralChat()
    fake_llm.set_handler(mistral)
    api = service(
        llm=fake_llm,
        llm_provider="mistral",
        llm_model="mistral-large-latest",
        react_self_reflection_interval=1,
    ).api()

    outcome = api.run(api.create_conversation()["id"], QUESTION)

    fake_llm.assert_done()
    assert mistral.refusals == []
    assert (outcome.done["status"], outcome.done["answer"]) == ("completed", ANSWER)
    assert _after_tool_result(fake_llm.requests[1], "[Self-reflection]") == ["tool", "assistant"]


def test_a_follow_up_after_tool_results_reaches_mistral_in_an_order_it_accepts(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    mistral = MistralChat()
    release = threading.Event()
    held: list[dict[str, Any]] = []

    def hold_the_first_reply(body: dict[str, Any]) -> FakeReply:
        reply = mistral(body)
        if held:
            return reply
        held.append(body)
        return FakeReply.blocked(release, reply)

    fake_llm.set_handler(hold_the_first_reply)
    api = service(llm=fake_llm, llm_provider="mistral", llm_model="mistral-large-latest").api()
    conversation = api.create_conversation()["id"]
    api.start_run(conversation, QUESTION)
    try:
        fake_llm.wait_for_requests(1)
        response = api.http.post(
            f"/api/conversations/{conversation}/interrupt", json={"content": "Say it in words too."}
        )
        assert response.status_code == 202, response.text
    finally:
        release.set()
    events = api.stream(conversation)

    fake_llm.assert_done()
    assert mistral.refusals == []
    assert [e.event for e in events].count("inject") == 1
    assert (events[-1].data["status"], events[-1].data["answer"]) == ("completed", ANSWER)
    assert _after_tool_result(fake_llm.requests[1], "Say it in words too.") == ["tool", "assistant"]


# -- streams and bodies that end badly ------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "settings"),
    [
        pytest.param(
            lambda: OpenRouterChat(error_after=2),
            {"llm_provider": "openrouter", "llm_model": "openai/gpt-oss-120b"},
            id="openrouter-error-chunk",
        ),
        pytest.param(
            lambda: LlamaCppServer(error_after=2),
            {"llm_provider": "llamacpp", "llm_model": "qwen2.5-7b-instruct"},
            id="llamacpp-error-line",
        ),
    ],
)
def test_an_error_inside_the_synthesis_stream_is_in_done_error_with_the_providers_message(
    service: ServiceFactory,
    fake_llm: FakeOpenAIServer,
    make: Callable[[], OpenRouterChat | LlamaCppServer],
    settings: dict[str, Any],
) -> None:
    fake = make()
    fake_llm.set_handler(fake)
    api = service(llm=fake_llm, **settings).api()

    outcome = api.run(api.create_conversation()["id"], QUESTION)

    fake_llm.assert_done()
    done = outcome.done
    assert done["status"] == "completed"
    assert done["error"].startswith("synthesis failed")
    assert fake.STREAM_ERROR in done["error"]
    assert "".join(streamed_answer(outcome)) == "The answer", "two words went out before the error"
    assert done["answer"] == ANSWER  # the loop's answer stands in for the broken one (E-04)


def test_a_refusal_in_geminis_list_shaped_error_body_shows_geminis_own_message(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake = GeminiOpenAI(key_valid=False)
    fake_llm.set_handler(fake)
    api = service(llm=fake_llm, **FAMILIES["gemini"].settings).api()

    outcome = api.run(api.create_conversation()["id"], QUESTION)

    fake_llm.assert_done()
    assert outcome.done["status"] == "failed"
    assert fake.BAD_KEY in outcome.done["error"]


def test_a_synthesis_stream_cut_at_the_length_limit_is_not_presented_as_complete(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake = ThinkTagServer(cut_after=len("The answer is"))
    fake_llm.set_handler(fake)
    api = service(llm=fake_llm, llm_provider="vllm", llm_model="Qwen/Qwen3-32B").api()

    outcome = api.run(api.create_conversation()["id"], QUESTION)

    fake_llm.assert_done()
    done = outcome.done
    assert done["status"] == "completed"
    assert "cut off" in done["error"]
    assert done["answer"] == "".join(streamed_answer(outcome)) == "The answer is"


def test_a_rate_limit_error_in_a_200_body_is_retried_and_the_run_completes(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake = OpenRouterChat(rate_limited=1)
    fake_llm.set_handler(fake)
    api = service(
        llm=fake_llm, llm_provider="openrouter", llm_model="openai/gpt-oss-120b", llm_max_retries=1
    ).api()

    outcome = api.run(api.create_conversation()["id"], QUESTION)

    fake_llm.assert_done()
    assert (outcome.done["status"], outcome.done["answer"]) == ("completed", ANSWER)
    first, retried = fake_llm.requests[:2]
    assert retried == first
    # Retried by the client within the call: no step saw an unusable reply, none was spent on it.
    assert step_reasonings(outcome) == fake.thoughts[:2]
    assert outcome.done["iterations"] == 2
    assert outcome.done["usage"]["llm_calls"] == len(fake_llm.requests) == 4


def test_tool_results_answer_their_own_call_when_the_provider_sends_empty_ids(
    service: ServiceFactory, fake_llm: FakeOpenAIServer
) -> None:
    fake = QuirkyGateway({"empty_ids"})
    fake_llm.set_handler(fake)
    api = service(llm=fake_llm).api()

    # Two steps: the answer is the result of the second call, found by that call's id.
    outcome = api.run(api.create_conversation()["id"], "What is 6*7, then 6*7+1?")

    fake_llm.assert_done()
    assert fake.served_ids == ["", ""]
    assert tool_steps(outcome) == [("calculator", "6*7 = 42", None), ("calculator", "6*7+1 = 43", None)]
    assert outcome.done["answer"] == NEXT_ANSWER
    messages = fake_llm.requests[2]["messages"]
    call_ids = [c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    result_ids = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert result_ids == call_ids and len(set(call_ids)) == 2 and all(call_ids)

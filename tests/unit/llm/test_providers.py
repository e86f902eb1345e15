"""Provider profiles: which profile a base URL, a model name or LLM_PROVIDER picks, and the history
each profile sends (``wire_messages``)."""

from __future__ import annotations

import re

import pytest

from app.llm.base import ChatMessage, ToolCall
from app.llm.providers import _HOSTS, ASSISTANT_BRIDGE, PROFILES, profile_for

GENERIC = PROFILES["openai-compatible"]
SIGNATURE = {"google": {"thought_signature": "c2lnbmF0dXJl"}}

# -- profile from the base URL ---------------------------------------------------------------

# The base URLs each provider documents for its OpenAI-compatible endpoint.
HOSTED = [
    ("https://api.openai.com/v1", "api.openai.com", "openai"),
    ("https://my-res.openai.azure.com/openai/deployments/gpt-4o", "openai.azure.com", "azure"),
    ("https://my-res.cognitiveservices.azure.com/openai/v1/", "cognitiveservices.azure.com", "azure"),
    ("https://my-project.services.ai.azure.com/models", "services.ai.azure.com", "azure"),
    ("https://api.deepseek.com", "api.deepseek.com", "deepseek"),
    (
        "https://generativelanguage.googleapis.com/v1beta/openai/",
        "generativelanguage.googleapis.com",
        "gemini",
    ),
    ("https://api.mistral.ai/v1", "api.mistral.ai", "mistral"),
    ("https://api.groq.com/openai/v1", "api.groq.com", "groq"),
    ("https://openrouter.ai/api/v1", "openrouter.ai", "openrouter"),
    ("https://api.together.xyz/v1", "api.together.xyz", "together"),
    ("https://api.together.ai/v1", "api.together.ai", "together"),
]


@pytest.mark.parametrize(("base_url", "host", "name"), HOSTED, ids=[h for _, h, _ in HOSTED])
def test_a_hosted_provider_is_recognised_by_its_host(base_url: str, host: str, name: str) -> None:
    assert profile_for(base_url, "some-model").name == name


def test_every_known_host_has_a_detection_test() -> None:
    assert sorted((host, name) for _, host, name in HOSTED) == sorted(_HOSTS)


def test_host_matching_ignores_case() -> None:
    assert profile_for("https://API.DeepSeek.COM/v1", "m").name == "deepseek"


@pytest.mark.parametrize(
    "base_url",
    [
        "https://myapi.deepseek.com/v1",
        "https://api.deepseek.com.example.org/v1",
        "https://fakeopenrouter.ai/v1",
    ],
)
def test_a_host_that_only_shares_letters_with_a_provider_is_not_that_provider(base_url: str) -> None:
    assert profile_for(base_url, "m") is GENERIC


@pytest.mark.parametrize("port", [11434, 1234, 8080, 8000, 30000])
def test_a_self_hosted_server_gets_the_generic_profile_whatever_its_port(port: int) -> None:
    # They all need what the generic profile does; a port proves nothing about what serves it.
    assert profile_for(f"http://localhost:{port}/v1", "m") == PROFILES["openai-compatible"]


def test_an_unknown_host_and_port_get_the_generic_profile() -> None:
    assert profile_for("http://10.0.0.7:9999/v1", "m") is GENERIC


def test_a_port_out_of_range_gets_the_generic_profile_instead_of_an_error() -> None:
    assert profile_for("http://localhost:99999/v1", "m") is GENERIC


def test_an_azure_deployment_path_behind_any_host_is_azure() -> None:
    assert profile_for("https://gateway.example.com/openai/deployments/gpt-4o-mini", "m").name == "azure"


def test_no_base_url_means_openai_itself() -> None:
    assert profile_for(None, "gpt-4o").name == "openai"


# -- model names -----------------------------------------------------------------------------

MISTRAL_MODELS = [
    "mistral-large-latest",
    "magistral-medium-2506",
    "ministral-8b-latest",
    "codestral-latest",
    "devstral-small-2505",
    "pixtral-12b",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
]


@pytest.mark.parametrize("model", MISTRAL_MODELS)
@pytest.mark.parametrize("base_url", ["https://openrouter.ai/api/v1", "http://localhost:8000/v1", None])
def test_a_mistral_model_gets_mistrals_rules_on_any_host(base_url: str | None, model: str) -> None:
    profile = profile_for(base_url, model)

    assert profile.assistant_after_tool is True
    assert profile.tool_call_id_length == 9


def test_a_mistral_model_keeps_the_hosts_profile_name() -> None:
    assert profile_for("https://openrouter.ai/api/v1", "mistralai/mistral-large").name == "openrouter"


def test_other_models_on_a_gateway_get_no_mistral_rules() -> None:
    profile = profile_for("https://openrouter.ai/api/v1", "meta-llama/llama-3.3-70b-instruct")

    assert (profile.assistant_after_tool, profile.tool_call_id_length) == (False, None)


@pytest.mark.parametrize(
    "model",
    [
        "Qwen/QwQ-32B",
        "deepseek-r1-distill-qwen-7b",
        "deepseek-ai/DeepSeek-R1",
        "Qwen3-235B-A22B-Thinking-2507",
    ],
)
def test_a_model_whose_template_opens_the_thinking_tag_opens_thinking(model: str) -> None:
    assert profile_for("http://localhost:8000/v1", model).opens_thinking is True


@pytest.mark.parametrize("model", ["qwen3-8b", "llama-3.1-8b-instruct", "deepseek-chat"])
def test_other_models_do_not_open_thinking(model: str) -> None:
    assert profile_for("http://localhost:8000/v1", model).opens_thinking is False


def test_a_profile_that_reads_no_think_tags_never_opens_thinking() -> None:
    assert profile_for("https://api.openai.com/v1", "qwq-32b").opens_thinking is False


# -- LLM_PROVIDER ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_can_be_named(name: str) -> None:
    assert profile_for("http://localhost:9999/v1", "m", name).name == name


def test_a_named_provider_overrides_the_host() -> None:
    assert profile_for("https://api.openai.com/v1", "m", "deepseek").name == "deepseek"


def test_a_provider_name_is_read_without_case_or_surrounding_spaces() -> None:
    assert profile_for(None, "m", "  Mistral ").name == "mistral"


def test_an_unknown_provider_name_is_a_value_error_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown LLM provider 'anthropic'.*deepseek.*mistral"):
        profile_for("https://api.openai.com/v1", "m", "anthropic")


def test_a_named_provider_is_taken_as_it_is_whatever_the_model_is_called() -> None:
    assert profile_for(None, "deepseek-r1-distill-llama-8b", "ollama") == PROFILES["ollama"]
    assert profile_for(None, "dolphin-mistral", "openai") == PROFILES["openai"]


# -- wire_messages ---------------------------------------------------------------------------


def tool_loop(call_id: str = "call_abc123def456") -> list[ChatMessage]:
    """A history with everything a profile may adapt: thinking, a call with a thought signature, a
    tool result and a user message right after it."""
    call = ToolCall(call_id, "calculator", '{"expression":"2+2"}', extra={"extra_content": SIGNATURE})
    return [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="what is 2+2?"),
        ChatMessage(role="assistant", content=None, tool_calls=(call,), reasoning="I should add."),
        ChatMessage(role="tool", content="4", tool_call_id=call_id),
        ChatMessage(role="user", content="Reflect on the result."),
        ChatMessage(role="assistant", content="4", reasoning="Easy."),
    ]


PASS_THROUGH = ["openai", "azure", "groq", "openrouter", "together", "vllm", "sglang", "ollama", "lmstudio"]


@pytest.mark.parametrize("name", [*PASS_THROUGH, "llamacpp", "openai-compatible"])
def test_a_profile_without_adaptations_sends_the_history_exactly_as_kept(name: str) -> None:
    """No reasoning_content, no extra_content, no bridge, the ids as they came."""
    history = tool_loop()

    assert PROFILES[name].wire_messages(history) == [m.to_openai() for m in history]


def test_deepseek_sends_the_reasoning_back_on_a_tool_calling_assistant_message() -> None:
    wire = PROFILES["deepseek"].wire_messages(tool_loop())

    assert wire[2]["reasoning_content"] == "I should add."
    assert wire[2]["tool_calls"][0]["id"] == "call_abc123def456"


def test_deepseek_sends_an_empty_reasoning_on_a_tool_call_stored_without_one() -> None:
    call = ToolCall("c1", "calculator", "{}")
    message = ChatMessage(role="assistant", tool_calls=(call,))

    assert PROFILES["deepseek"].wire_messages([message])[0]["reasoning_content"] == ""


def test_deepseek_adds_reasoning_only_to_assistant_messages() -> None:
    wire = PROFILES["deepseek"].wire_messages(
        [*tool_loop(), ChatMessage(role="assistant", content="no thinking kept")]
    )

    assert [i for i, m in enumerate(wire) if "reasoning_content" in m] == [2, 5]
    assert wire[5]["reasoning_content"] == "Easy."


def test_deepseek_sends_no_thought_signature() -> None:
    wire = PROFILES["deepseek"].wire_messages(tool_loop())

    assert "extra_content" not in wire[2]["tool_calls"][0]


def test_gemini_sends_the_thought_signature_back_on_its_tool_call() -> None:
    wire = PROFILES["gemini"].wire_messages(tool_loop())

    assert wire[2]["tool_calls"][0]["extra_content"] == SIGNATURE
    assert wire[2]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression":"2+2"}'}


def test_gemini_sends_no_reasoning_content() -> None:
    assert all("reasoning_content" not in m for m in PROFILES["gemini"].wire_messages(tool_loop()))


def test_gemini_sends_back_only_the_fields_it_needs() -> None:
    call = ToolCall("c1", "f", "{}", extra={"extra_content": SIGNATURE, "index": 3})

    sent = PROFILES["gemini"].wire_messages([ChatMessage(role="assistant", tool_calls=(call,))])

    assert sent[0]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
        "extra_content": SIGNATURE,
    }


def test_gemini_keeps_extra_content_from_a_reply_call_and_other_profiles_keep_nothing() -> None:
    raw = {"id": "c1", "type": "function", "extra_content": SIGNATURE, "function": {"name": "f"}}

    assert PROFILES["gemini"].kept_call_fields(raw) == {"extra_content": SIGNATURE}
    assert GENERIC.kept_call_fields(raw) is None
    assert PROFILES["gemini"].kept_call_fields({"id": "c1", "extra_content": None}) is None


def test_mistral_puts_an_assistant_message_between_a_tool_result_and_a_user_message() -> None:
    wire = PROFILES["mistral"].wire_messages(tool_loop())

    assert [m["role"] for m in wire] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert wire[4] == {"role": "assistant", "content": ASSISTANT_BRIDGE}
    assert wire[5]["content"] == "Reflect on the result."


def test_mistral_adds_no_bridge_where_no_user_follows_a_tool() -> None:
    call = ToolCall("abcDEF123", "f", "{}")
    history = [
        ChatMessage(role="user", content="q"),
        ChatMessage(role="assistant", tool_calls=(call,)),
        ChatMessage(role="tool", content="r", tool_call_id="abcDEF123"),
        ChatMessage(role="assistant", content="done"),
        ChatMessage(role="user", content="thanks"),
    ]

    assert PROFILES["mistral"].wire_messages(history) == [m.to_openai() for m in history]


def test_mistral_sends_nine_character_ids_that_still_pair_the_call_with_its_result() -> None:
    wire = PROFILES["mistral"].wire_messages(tool_loop("call_abc123def456"))

    call_id = wire[2]["tool_calls"][0]["id"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id)
    assert wire[3]["tool_call_id"] == call_id


def test_mistral_maps_the_same_id_to_the_same_short_id_in_every_request() -> None:
    first = PROFILES["mistral"].wire_messages(tool_loop("call_abc123def456"))
    again = profile_for("https://api.mistral.ai/v1", "mistral-large-latest").wire_messages(
        tool_loop("call_abc123def456")
    )

    assert first[2]["tool_calls"][0]["id"] == again[2]["tool_calls"][0]["id"]


def test_mistral_maps_different_ids_to_different_short_ids() -> None:
    ids = {PROFILES["mistral"].wire_messages(tool_loop(f"call_{n}"))[3]["tool_call_id"] for n in range(50)}

    assert len(ids) == 50


def test_mistral_keeps_an_id_that_is_already_nine_alphanumerics() -> None:
    wire = PROFILES["mistral"].wire_messages(tool_loop("D681PevKs"))

    assert (wire[2]["tool_calls"][0]["id"], wire[3]["tool_call_id"]) == ("D681PevKs", "D681PevKs")


def test_mistral_sends_no_reasoning_and_no_thought_signature() -> None:
    wire = PROFILES["mistral"].wire_messages(tool_loop())

    assert all("reasoning_content" not in m for m in wire)
    assert "extra_content" not in wire[2]["tool_calls"][0]


def test_a_tool_message_never_carries_a_name() -> None:
    message = ChatMessage(role="tool", content="r", tool_call_id="c1", name="calculator")

    for profile in PROFILES.values():
        assert "name" not in profile.wire_messages([message])[0]


def test_other_messages_keep_their_name() -> None:
    message = ChatMessage(role="user", content="hi", name="alice")

    assert GENERIC.wire_messages([message]) == [{"role": "user", "content": "hi", "name": "alice"}]

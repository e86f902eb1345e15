"""A2A push notification configs (FACES.md N-02, N-06) through the official ``a2a-sdk`` client: create,
get, list and delete on a task (another owner's is TaskNotFound), a config sent with the message
that gets the task's changes posted to a receiver on loopback (the approval it waits for, then the
end, each a ``StreamResponse`` with the config's credentials), and what the service does not take
refused when given, nothing stored: URLs it does not post to, credentials no header can carry, an
eleventh config of a task, a config with a message that is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from a2a.types.a2a_pb2 import (
    AuthenticationInfo,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    TaskPushNotificationConfig,
)
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError

from tests.integration.faces.a2a_support import (
    BOB,
    COMPLETED,
    INPUT_REQUIRED,
    KEYS,
    a2a_client,
    collect,
    data,
    message,
    send,
    states,
)
from tests.integration.service.workers_support import (  # noqa: F401  (fixtures)
    FakeLLM,
    gated_llm_fixture,
    redis_prefix_fixture,
    start_service_fixture,
)
from tests.support.fake_agents import ToolAgentBehaviour
from tests.support.server import ServerThread, async_wait_until
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.timeout(60)

LOOPBACK = {"webhook_allow_private": True, "webhook_allowed_hosts": "127.0.0.1", "webhook_retry_s": 0.05}
APPROVING = {"mode": "json", "tools": ["calculator"], "require_approval": ["calculator"]}


@pytest.fixture
def service(start_service: Callable[..., ServerThread]) -> ServerThread:
    return start_service(redis=False, api_keys=KEYS, **LOOPBACK)


async def test_push_configs_are_created_read_listed_and_deleted_per_owner(service: ServerThread) -> None:
    async with a2a_client(service.base_url, streaming=False) as client:
        (sent,) = await collect(client.send_message(send(message("what is 6*7?"))))
        task_id = sent.task.id
        made = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(
                task_id=task_id,
                id="hook-1",
                url="http://127.0.0.1:9/hook",
                token="t0k",
                authentication=AuthenticationInfo(scheme="Bearer", credentials="s3cret"),
            )
        )
        assert (made.id, made.task_id, made.url, made.token) == (
            "hook-1",
            task_id,
            "http://127.0.0.1:9/hook",
            "t0k",
        )
        assert (made.authentication.scheme, made.authentication.credentials) == ("Bearer", "s3cret")
        unnamed = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=task_id, url="http://127.0.0.1:9/other")
        )
        assert unnamed.id and unnamed.id != "hook-1"

        got = await client.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=task_id, id="hook-1")
        )
        assert got == made
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert [c.id for c in listed.configs] == ["hook-1", unnamed.id]

        for refused in (
            "http://10.0.0.1/hook",
            "https://example.com/hook",
            "ftp://127.0.0.1/x",
            "http://u:p@127.0.0.1/",
        ):
            with pytest.raises(InvalidParamsError):
                await client.create_task_push_notification_config(
                    TaskPushNotificationConfig(task_id=task_id, url=refused)
                )
        with pytest.raises(TaskNotFoundError):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id="run_nothing", url="http://127.0.0.1:9/hook")
            )

        async with a2a_client(service.base_url, BOB, streaming=False) as bob:
            with pytest.raises(TaskNotFoundError):
                await bob.get_task_push_notification_config(
                    GetTaskPushNotificationConfigRequest(task_id=task_id, id="hook-1")
                )
            with pytest.raises(TaskNotFoundError):
                await bob.list_task_push_notification_configs(
                    ListTaskPushNotificationConfigsRequest(task_id=task_id)
                )
            with pytest.raises(TaskNotFoundError):
                await bob.create_task_push_notification_config(
                    TaskPushNotificationConfig(task_id=task_id, url="http://127.0.0.1:9/bob")
                )

        delete = DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="hook-1")
        await client.delete_task_push_notification_config(delete)
        await client.delete_task_push_notification_config(delete)  # idempotent
        with pytest.raises(TaskNotFoundError):
            await client.get_task_push_notification_config(
                GetTaskPushNotificationConfigRequest(task_id=task_id, id="hook-1")
            )
        left = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert [c.id for c in left.configs] == [unnamed.id]


async def test_a_config_sent_with_the_message_gets_the_waiting_and_the_end_posted(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    with WebhookReceiver() as receiver:
        request = send(message("what is 6*7?"), agent=APPROVING)
        request.configuration.task_push_notification_config.CopyFrom(
            TaskPushNotificationConfig(
                url=receiver.url,
                token="task-token",
                authentication=AuthenticationInfo(scheme="Bearer", credentials="push-secret"),
            )
        )
        async with a2a_client(service.base_url) as client:
            first = await collect(client.send_message(request))
            task = first[0].task
            assert states(first)[-1] == INPUT_REQUIRED
            (waiting,) = await asyncio.to_thread(receiver.wait_accepted, 1)
            body = waiting.json()
            assert body["statusUpdate"]["taskId"] == task.id
            assert body["statusUpdate"]["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            (asked,) = [p["data"] for p in body["statusUpdate"]["status"]["message"]["parts"] if "data" in p]
            assert asked["tool_name"] == "calculator"
            assert waiting.headers["authorization"] == "Bearer push-secret"
            assert waiting.headers["x-a2a-notification-token"] == "task-token"

            decision = message(
                data({"approval_id": asked["approval_id"], "decision": "approve"}), task_id=task.id
            )
            rest = await collect(client.send_message(send(decision)))
            assert states(rest)[-1] == COMPLETED
        received = await asyncio.to_thread(receiver.wait_accepted, 4)
    bodies = [r.json() for r in received]
    # Each change is a delivery of its own (made at least once, each on its own schedule): it
    # waits, goes on once decided, ends; and the answer.
    statuses = sorted(b["statusUpdate"]["status"]["state"] for b in bodies if "statusUpdate" in b)
    assert statuses == ["TASK_STATE_COMPLETED", "TASK_STATE_INPUT_REQUIRED", "TASK_STATE_WORKING"]
    (artifact,) = [b["artifactUpdate"]["artifact"] for b in bodies if "artifactUpdate" in b]
    assert artifact["parts"][0]["text"] == gated_llm.agent.answer
    assert all(r.headers["authorization"] == "Bearer push-secret" for r in received)


async def test_a_refused_push_url_with_a_message_starts_nothing(service: ServerThread) -> None:
    request = send(message("what is 6*7?"))
    request.configuration.task_push_notification_config.CopyFrom(
        TaskPushNotificationConfig(url="http://192.168.1.10/hook")
    )
    async with a2a_client(service.base_url, streaming=False) as client:
        with pytest.raises(InvalidParamsError):
            await collect(client.send_message(request))
        assert list((await client.list_tasks(ListTasksRequest())).tasks) == []


async def test_a_task_takes_ten_push_configs_at_most(service: ServerThread, gated_llm: FakeLLM) -> None:
    gated_llm.agent.close_gate()  # the task works until the gate opens
    async with a2a_client(service.base_url, streaming=False) as client:
        (sent,) = await collect(client.send_message(send(message("count to ten"), return_immediately=True)))
        task_id = sent.task.id
        for i in range(10):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task_id, id=f"c{i}", url=f"http://127.0.0.1:9/{i}")
            )
        with pytest.raises(InvalidParamsError):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task_id, id="c10", url="http://127.0.0.1:9/10")
            )
        # One of the ten given again replaces itself.
        again = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=task_id, id="c3", url="http://127.0.0.1:9/again")
        )
        assert again.url == "http://127.0.0.1:9/again"
        # An eleventh with a follow-up: refused before the follow-up is taken.
        follow_up = send(message("and in hex, please", task_id=task_id))
        follow_up.configuration.task_push_notification_config.CopyFrom(
            TaskPushNotificationConfig(id="c11", url="http://127.0.0.1:9/11")
        )
        with pytest.raises(InvalidParamsError):
            await collect(client.send_message(follow_up))
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert sorted(c.id for c in listed.configs) == sorted(f"c{i}" for i in range(10))
        gated_llm.agent.gate.set()

        async def completed() -> bool:
            return (await client.get_task(GetTaskRequest(id=task_id))).status.state == COMPLETED

        await async_wait_until(completed, what="the task's end")
    assert not gated_llm.agent.saw("and in hex, please")


async def test_credentials_no_header_can_carry_are_refused_when_given(service: ServerThread) -> None:
    async with a2a_client(service.base_url, streaming=False) as client:
        (sent,) = await collect(client.send_message(send(message("what is 6*7?"))))
        task_id = sent.task.id
        url = "http://127.0.0.1:9/hook"

        def bearer(credentials: str, scheme: str = "Bearer") -> AuthenticationInfo:
            return AuthenticationInfo(scheme=scheme, credentials=credentials)

        for refused in (
            TaskPushNotificationConfig(task_id=task_id, url=url, token="t\u00e9"),
            TaskPushNotificationConfig(task_id=task_id, url=url, token="t\x7f"),
            TaskPushNotificationConfig(task_id=task_id, url=url, token=" t"),
            TaskPushNotificationConfig(task_id=task_id, url=url, authentication=bearer("s\u00e9")),
            TaskPushNotificationConfig(task_id=task_id, url=url, authentication=bearer("a\x7fb")),
            TaskPushNotificationConfig(task_id=task_id, url=url, authentication=bearer("s", "B\u00e9arer")),
        ):
            with pytest.raises(InvalidParamsError):
                await client.create_task_push_notification_config(refused)
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert list(listed.configs) == []


async def test_a_refused_message_on_a_task_stores_no_push_config(
    service: ServerThread, gated_llm: FakeLLM
) -> None:
    gated_llm.agent.inner = ToolAgentBehaviour("calculator", {"expression": "6*7"})
    async with a2a_client(service.base_url, streaming=False) as client:
        (first,) = await collect(client.send_message(send(message("what is 6*7?"), agent=APPROVING)))
        task_id = first.task.id
        assert first.task.status.state == INPUT_REQUIRED
        for refused in (
            message(data({"approval_id": "apr_nothing", "decision": "approve"}), task_id=task_id),
            message("go on", task_id=task_id),  # it waits for a decision
        ):
            request = send(refused)
            request.configuration.task_push_notification_config.CopyFrom(
                TaskPushNotificationConfig(id="hook", url="http://127.0.0.1:9/hook")
            )
            with pytest.raises(InvalidParamsError):
                await collect(client.send_message(request))
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id)
        )
        assert list(listed.configs) == []

"""The protocol faces' chats and threads in the database (FACES.md V-02, G-02), on SQLite and
PostgreSQL: a client's id names one conversation per owner and face, created once with its history
and the client's message ids, also when two requests create it at the same moment."""

from __future__ import annotations

import asyncio

from app.db.repositories import ConversationRepo
from app.db.repositories.face_threads import FaceThreadRepo
from app.db.session import Database
from app.llm.base import ChatMessage

HISTORY = [
    (ChatMessage(role="user", content="hi"), "u1"),
    (ChatMessage(role="assistant", content="hello"), None),
]


async def test_an_id_names_one_conversation_per_owner_and_face_created_with_its_history(
    database: Database,
) -> None:
    threads = FaceThreadRepo(database.sessionmaker)
    conversations = ConversationRepo(database.sessionmaker)

    made, created = await threads.open(
        "alice", "ai-sdk", "c1", title="t", agent_config={"mode": "json"}, history=HISTORY
    )
    again, created_again = await threads.open("alice", "ai-sdk", "c1", title="other", agent_config={})
    others = [
        (await threads.open(owner, face, "c1", title="t", agent_config={}))[0].id
        for owner, face in (("bob", "ai-sdk"), ("alice", "ag-ui"))
    ]

    assert (created, created_again) == (True, False)
    assert again.id == made.id and again.agent_config == {"mode": "json"}
    assert len({made.id, *others}) == 3
    messages, head = await conversations.branch(made.id)
    assert [(m.role, m.content, m.client_id) for m in messages] == [
        ("user", "hi", "u1"),
        ("assistant", "hello", None),
    ]
    assert head == messages[-1].seq == made.head_seq
    assert await threads.find("alice", "ai-sdk", "c2") is None
    assert (await threads.find("alice", "ai-sdk", "c1")) == again


async def test_two_requests_that_create_the_same_chat_at_once_get_one_conversation(
    database: Database,
) -> None:
    threads = FaceThreadRepo(database.sessionmaker)

    opened = await asyncio.gather(
        *(
            threads.open("alice", "ai-sdk", "race", title="t", agent_config={}, history=HISTORY)
            for _ in range(6)
        )
    )

    assert len({conv.id for conv, _ in opened}) == 1
    assert sum(created for _, created in opened) == 1
    (only,) = (await ConversationRepo(database.sessionmaker).list("alice", 10, None))[0]
    messages, _ = await ConversationRepo(database.sessionmaker).branch(only.id)
    assert len(messages) == 2

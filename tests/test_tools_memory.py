"""The note tools (memory_save, memory_search, memory_delete) through the real
daemon: the fake OpenAI-compatible server scripts the model's calls, the runner's
recall store (`gateway.memory.recall`, hash embeddings: the zero-config default) keeps
the notes. Scopes: the asking user's notes under the asking agent, nobody else's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.memory.recall import Namespace
from gateway.run import GatewayRunner
from gateway.session import Platform, SessionSource
from tests.fakes.openai_server import FakeOpenAI, tool_calls, tool_results
from tests.gateway_client import GatewayClient
from tests.pg_support import StorageBackend


class Gateway:
    def __init__(self, runner: GatewayRunner, client: GatewayClient, fake: FakeOpenAI) -> None:
        self.runner, self.client, self.fake = runner, client, fake

    async def ask(self, user: str, text: str, *answers: str | dict[str, Any]) -> str:
        """One turn of `user` (in their DM) whose model answers with `answers`."""
        self.fake.script(*answers)
        await self.client.post(f"dm-{user}", text, user_id=user)
        (reply,) = await self.client.replies(f"dm-{user}", 1)
        return reply

    def results(self) -> list[Any]:
        """The results of the last tool round the model was sent."""
        return [r["content"] for r in tool_results(self.fake.requests[-1]["json"])]


@pytest.fixture
async def gateway(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[Gateway]:
    """The runner on either store backend (the notes and their index live on
    PostgreSQL too)."""
    async with started(tmp_path, store_backend) as gw:
        yield gw


@asynccontextmanager
async def started(
    tmp_path: Path,
    store_backend: StorageBackend,
    memory: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[Gateway]:
    async with FakeOpenAI(check_pairing=True) as fake:
        config = GatewayConfig.model_validate(
            {
                "timezone": "UTC",
                "platforms": {"http": {"enabled": True, "port": 0}},
                "agent": {"backend": "openai", "base_url": fake.base_url, "model": "m"},
                "memory": memory or {},
                "session_reset": {"mode": "none"},
                **settings,
            }
        )
        config = store_backend.apply(config)
        adapter = HttpAdapter(config.platforms.http)
        runner = GatewayRunner(config, [adapter], home=tmp_path)
        await runner.start()
        gw = Gateway(runner, GatewayClient(adapter.url), fake)
        try:
            yield gw
        finally:
            await gw.client.close()
            await runner.stop()


def alice(agent: str = "main") -> Any:
    return Namespace.of(agent, SessionSource(platform=Platform.HTTP, chat_id="x", user_id="alice"))


async def test_a_note_saved_in_one_session_is_found_in_a_later_one_by_its_user_only(
    gateway: Gateway,
) -> None:
    save = tool_calls(
        ("memory_save", {"content": "Alice's cat is called Biscuit", "tags": ["Pets"]})
    )
    assert await gateway.ask("alice", "remember my cat", save, "saved") == "saved"
    (saved,) = gateway.results()
    note_id = saved["note_id"]
    assert note_id.startswith("note-")
    await gateway.ask("alice", "/new")

    search = tool_calls(("memory_search", {"query": "Alice's cat is called Biscuit"}))
    assert await gateway.ask("alice", "what is my cat called?", search, "Biscuit") == "Biscuit"
    (found,) = gateway.results()
    notes = [hit for hit in found["results"] if hit["kind"] == "note"]
    assert [(n["id"], n["text"], n["tags"]) for n in notes] == [
        (note_id, "Alice's cat is called Biscuit", ["pets"])
    ]

    # Bob asks the same: none of Alice's notes, nor her transcripts.
    search = tool_calls(("memory_search", {"query": "Alice's cat is called Biscuit"}))
    await gateway.ask("bob", "what is alice's cat called?", search, "no idea")
    (found,) = gateway.results()
    assert all("Biscuit" not in hit["text"] for hit in found["results"])


async def test_another_agents_notes_are_not_found(gateway: Gateway) -> None:
    await gateway.runner.recall.save(alice("helper"), "the helper's secret: pelican")
    search = tool_calls(("memory_search", {"query": "the helper's secret: pelican"}))
    await gateway.ask("alice", "secrets?", search, "none")
    (found,) = gateway.results()
    assert all("pelican" not in hit["text"] for hit in found["results"])
    # ... while the same note under this agent (main, from the session key) is found.
    await gateway.runner.recall.save(alice(), "the main secret: pelican")
    search = tool_calls(("memory_search", {"query": "the main secret: pelican"}))
    await gateway.ask("alice", "secrets now?", search, "one")
    (found,) = gateway.results()
    assert [h["text"] for h in found["results"] if h["kind"] == "note"] == [
        "the main secret: pelican"
    ]


async def test_update_and_delete_by_id_and_mistakes_are_results(gateway: Gateway) -> None:
    note_id = await gateway.runner.recall.save(alice(), "likes tea")
    rounds = tool_calls(
        ("memory_save", {"content": "likes coffee now", "note_id": note_id}),
        ("memory_save", {"content": "x", "note_id": "not-a-note"}),
        ("memory_delete", {"note_id": "note-00000000-0000-0000-0000-000000000000"}),
        ("memory_search", {"query": "coffee", "k": 0}),
        ("memory_save", {"content": ""}),
    )
    assert await gateway.ask("alice", "I switched to coffee", rounds, "updated") == "updated"
    updated, bad_id, missing, bad_k, empty = gateway.results()
    assert updated == {"note_id": note_id}
    assert bad_id["error"].startswith("memory_save: ")
    assert missing == {"deleted": False}
    assert bad_k["error"].startswith("memory_search: bad arguments: k:")
    assert empty["error"].startswith("memory_save: bad arguments: content:")
    (note,) = await gateway.runner.recall.list_notes(alice())
    assert (note.id, note.text) == (note_id, "likes coffee now")

    delete = tool_calls(("memory_delete", {"note_id": note_id}))
    await gateway.ask("alice", "forget it", delete, "forgotten")
    assert gateway.results() == [{"deleted": True}]
    assert await gateway.runner.recall.list_notes(alice()) == []


async def test_bob_cannot_delete_alices_note_by_its_id(gateway: Gateway) -> None:
    note_id = await gateway.runner.recall.save(alice(), "alice's note")
    delete = tool_calls(("memory_delete", {"note_id": note_id}))
    await gateway.ask("bob", "delete that", delete, "tried")
    assert gateway.results() == [{"deleted": False}]
    assert [n.id for n in await gateway.runner.recall.list_notes(alice())] == [note_id]
    rows = json.dumps([r["json"] for r in gateway.fake.requests])
    assert "alice's note" not in rows


async def test_a_search_in_a_turn_finds_the_note_not_the_turns_own_question(
    gateway: Gateway,
) -> None:
    """The model searches with the user's own words: the question just asked (indexed
    like any message) is not an answer to itself; the saved note is."""
    note_id = await gateway.runner.recall.save(alice(), "Alice's cat is called Biscuit")
    question = "what is my cat called"
    search = tool_calls(("memory_search", {"query": question}))
    assert await gateway.ask("alice", question, search, "Biscuit") == "Biscuit"
    (found,) = gateway.results()
    assert [hit["text"] for hit in found["results"] if hit["text"] == question] == []
    assert found["results"][0]["id"] == note_id
    # Indexed all the same: from a later session it is a past conversation, found.
    await gateway.ask("alice", "/new")
    search = tool_calls(("memory_search", {"query": question}))
    await gateway.ask("alice", "did I ask about my cat before?", search, "yes")
    (found,) = gateway.results()
    assert question in [hit["text"] for hit in found["results"]]


async def test_the_sessions_newest_messages_are_not_recalled_older_ones_are(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    """`memory.exclude_recent_messages`: the current session's newest N messages before
    the turn (the model has them in its context) are left out, older ones are not."""
    async with started(tmp_path, store_backend, {"exclude_recent_messages": 2}) as gw:
        await gw.ask("alice", "my favourite tea is genmaicha", "noted")
        await gw.ask("alice", "my favourite coffee is mocha", "noted too")
        query = "favourite tea genmaicha coffee mocha"
        search = tool_calls(("memory_search", {"query": query, "k": 10}))
        await gw.ask("alice", "what do I like to drink?", search, "tea")
        (found,) = gw.results()
        texts = [hit["text"] for hit in found["results"]]
        assert "my favourite tea is genmaicha" in texts  # older than the newest 2
        assert "my favourite coffee is mocha" not in texts  # among them
        assert "what do I like to drink?" not in texts  # the turn's own


# --- auto_recall: notes reach the prompt without a tool call ----------------------------


def chat_requests(fake: FakeOpenAI) -> list[dict[str, Any]]:
    return [r["json"] for r in fake.requests if r["path"] == "/v1/chat/completions"]


def system_of(body: dict[str, Any]) -> str:
    (system,) = [m["content"] for m in body["messages"] if m["role"] == "system"]
    return system


async def test_after_new_a_saved_note_reaches_the_prompt_with_no_tool_call(
    gateway: Gateway,
) -> None:
    save = tool_calls(("memory_save", {"content": "Alice works as a carpenter in Oslo"}))
    await gateway.ask("alice", "I work as a carpenter in Oslo, remember that", save, "noted")
    await gateway.ask("alice", "/new")
    asked = len(chat_requests(gateway.fake))

    assert await gateway.ask("alice", "which city do I work in as a carpenter?", "Oslo") == "Oslo"
    (body,) = chat_requests(gateway.fake)[asked:]  # one request: the model called no tool
    assert [m["role"] for m in body["messages"]] == ["system", "user"]  # a fresh session
    system = system_of(body)
    assert "## Notes you saved about this user" in system
    assert "- Alice works as a carpenter in Oslo" in system
    # The default prompt says what the agent is and which tools it has.
    assert system.startswith("Agent 'main' of hermes-gateway")
    assert "Tools you may call: " in system and "memory_search" in system

    # Bob asks the same: Alice's note never reaches his prompt.
    asked = len(chat_requests(gateway.fake))
    await gateway.ask("bob", "which city do I work in as a carpenter?", "no idea")
    (body,) = chat_requests(gateway.fake)[asked:]
    assert "carpenter in Oslo" not in system_of(body)
    assert "## Notes you saved" not in system_of(body)


async def test_another_agents_notes_never_reach_the_prompt(gateway: Gateway) -> None:
    await gateway.runner.recall.save(alice("helper"), "the helper's secret: pelican")
    await gateway.ask("alice", "what is the secret pelican?", "none")
    assert "pelican" not in system_of(chat_requests(gateway.fake)[-1])
    # ... while the same note under this agent (main, from the session key) is there.
    await gateway.runner.recall.save(alice(), "the main secret: pelican")
    await gateway.ask("alice", "what is the secret pelican now?", "one")
    assert "- the main secret: pelican" in system_of(chat_requests(gateway.fake)[-1])


async def test_a_shared_group_session_gets_no_users_notes(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    """One turn of a shared session may carry several users' messages: no one's notes
    go into its prompt (the tools still answer the asking user)."""
    async with started(tmp_path, store_backend, group_sessions_per_user=False) as gw:
        await gw.runner.recall.save(alice(), "Alice works as a carpenter in Oslo")
        gw.fake.script("a group answer")
        await gw.client.post("g1", "where do I work as a carpenter?", "alice", chat_type="group")
        await gw.client.replies("g1", 1)
        assert "carpenter in Oslo" not in system_of(chat_requests(gw.fake)[-1])
        assert "Multi-user" in system_of(chat_requests(gw.fake)[-1])  # it was shared
        await gw.ask("alice", "where do I work as a carpenter?", "Oslo")  # her DM: there
        assert "carpenter in Oslo" in system_of(chat_requests(gw.fake)[-1])


async def test_auto_recall_zero_puts_no_note_in_the_prompt(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    async with started(tmp_path, store_backend, {"auto_recall": 0}) as gw:
        await gw.runner.recall.save(alice(), "Alice works as a carpenter in Oslo")
        await gw.ask("alice", "where do I work as a carpenter?", "Oslo")
        assert "carpenter" not in system_of(chat_requests(gw.fake)[-1])


async def test_a_stalled_embeddings_server_costs_the_turn_seconds_not_the_turn(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    """The query's vector is waited for a bounded time; the note is then found by its
    words, and the turn answers."""
    async with FakeOpenAI() as embeddings:
        memory = {"embedding": "openai", "base_url": embeddings.base_url, "dimensions": 8}
        async with started(tmp_path, store_backend, memory) as gw:
            await gw.runner.recall.save(alice(), "Alice works as a carpenter in Oslo")
            release = embeddings.hold(lambda body: True, path="/v1/embeddings")
            try:
                reply = await gw.ask("alice", "what do I do as a carpenter?", "you build")
                assert reply == "you build"
                assert "carpenter in Oslo" in system_of(chat_requests(gw.fake)[-1])
                assert embeddings.held  # the turn did ask for the vector
            finally:
                release.set()

"""A summary that must be shortened ends at a sentence, else at a word, within its
bound (measured as the summary is, by `token_chars`), in any script; the model is asked
for a length that fits the bound."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from gateway.agents.openai import OpenAIAgent, summary_messages
from gateway.agents.protocol import SummaryRequest
from gateway.context import condense
from gateway.context.condense import clip_at_boundary
from gateway.context.tokens import token_chars
from tests.fakes.openai_server import FakeOpenAI

ENGLISH = (
    "The user works as a carpenter in Oslo and builds furniture from reclaimed oak. "
    "They asked for a plan to insulate their workshop before winter, with a budget of "
    "about twelve thousand kroner. We compared mineral wool with wood fibre boards and "
    "agreed that wood fibre suits the old timber walls better, although it costs more. "
    "Open question: whether the floor needs insulation too."
)
# "The user is a carpenter in Oslo. They want to insulate the workshop before winter."
JAPANESE = (
    "ユーザーはオスロの大工です。冬の前に作業場を断熱したいと考えています。"
    "予算は約一万二千クローネです。"
)
CHINESE_RUN = "用户是奥斯陆的木匠冬天之前想给工作室做保温预算大约一万两千克朗" * 3  # no stops


def test_a_cut_ends_at_the_last_sentence_that_fits() -> None:
    clipped = clip_at_boundary(ENGLISH, 200)
    assert clipped.endswith("twelve thousand kroner.")
    assert len(clipped) <= 200 and ENGLISH.startswith(clipped)


def test_without_a_sentence_end_in_reach_the_cut_is_between_words() -> None:
    text = "reclaimed oak, " * 40  # one long sentence
    clipped = clip_at_boundary(text, 100, "...")
    assert clipped.endswith("oak,...") and len(clipped) <= 100
    assert clipped[:-3].split() == text.split()[: len(clipped[:-3].split())]  # whole words


def test_a_sentence_end_too_early_gives_way_to_a_word_end() -> None:
    text = "Yes. " + "and then the user talked about many other things " * 5
    clipped = clip_at_boundary(text, 122)
    assert len(clipped) > 60  # not "Yes.": a cut that keeps less than half the room
    assert text.startswith(clipped) and text[len(clipped)] == " "  # between words


def test_japanese_is_cut_after_its_full_stop() -> None:
    limit = token_chars(JAPANESE) - 20  # the last sentence does not fit
    clipped = clip_at_boundary(JAPANESE, limit)
    assert clipped == "ユーザーはオスロの大工です。冬の前に作業場を断熱したいと考えています。"
    assert token_chars(clipped) <= limit


def test_a_script_without_spaces_or_stops_is_cut_at_the_last_character_that_fits() -> None:
    clipped = clip_at_boundary(CHINESE_RUN, 100, "...")
    assert clipped.endswith("...") and token_chars(clipped) <= 100
    assert token_chars(clipped) > 100 - 4 - 3  # as much as fits: one ideograph less at most
    assert CHINESE_RUN.startswith(clipped[:-3])


def test_text_that_fits_is_left_as_it_is() -> None:
    assert clip_at_boundary(ENGLISH, len(ENGLISH)) == ENGLISH
    assert clip_at_boundary(JAPANESE, token_chars(JAPANESE), "...") == JAPANESE


def test_every_cut_stays_within_the_bound_and_starts_the_text() -> None:
    pieces = ["word", "longerword", "a", "Sentence.", "end!", "字", "。", "\uff0c", "\n", "ü", "😀"]
    rng = random.Random(7)
    for _ in range(500):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        limit = rng.randint(0, 200)
        ellipsis = rng.choice(["", "..."])
        clipped = clip_at_boundary(text, limit, ellipsis)
        if clipped == text:
            assert token_chars(text) <= limit
            continue
        assert token_chars(clipped) <= max(limit, len(ellipsis)), (text, limit)
        assert text.startswith(clipped.removesuffix(ellipsis))


def test_a_model_summary_above_the_extractive_list_is_cut_at_a_sentence() -> None:
    text = condense.extractive(ENGLISH, [{"role": "user", "content": "hi"}], 200)
    assert text.endswith("...") and len(text) <= 200
    kept = text.removesuffix("...")
    assert ENGLISH.startswith(kept) and kept.endswith(".")  # whole sentences


def test_a_long_message_becomes_a_bullet_cut_between_words() -> None:
    text = "Note: " + ENGLISH
    (bullet,) = condense.bullets([{"role": "user", "content": text}])
    assert bullet.endswith("...") and len(bullet) <= len("- user: ") + condense.BULLET_CHARS
    kept = bullet.removeprefix("- user: ").removesuffix("...")
    assert text.startswith(kept) and text[len(kept)] in " ."


@pytest.mark.parametrize("max_chars", [200, 800, 3000])
def test_the_length_asked_for_fits_the_bound(max_chars: int) -> None:
    """A summary of as many English words as asked (words of this very prose) fits
    `max_chars`, so the model's answer is not cut; a CJK summary of as many characters
    as asked fits it too."""
    request = SummaryRequest("k", "s", None, ({"role": "user", "content": "hi"},), max_chars)
    instructions = summary_messages(request)[0]["content"]
    asked = instructions.split("Use at most ")[1]
    words = int(asked.split(" words")[0])
    ideographs = int(asked.split("at most ")[1].split(" characters")[0])
    prose = (ENGLISH + " ") * 40
    assert len(" ".join(prose.split()[:words])) <= max_chars
    assert words * 5 >= max_chars * 0.6  # and not far below it: the room is used
    assert token_chars((CHINESE_RUN * 10)[:ideographs]) <= max_chars


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


async def test_a_model_summary_too_long_is_cut_at_a_sentence(fake: FakeOpenAI) -> None:
    fake.script(ENGLISH)
    agent = OpenAIAgent(base_url=fake.base_url, model="m")
    request = SummaryRequest("k", "s", None, ({"role": "user", "content": "hi"},), 200)
    try:
        summary = await agent.summarize(request)
    finally:
        await agent.close()
    assert summary.endswith("twelve thousand kroner.") and len(summary) <= 200

"""Reply splitting: within the platform limit as the platform counts, nothing lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.base import split_message, utf16_len


def test_short_text_is_one_chunk() -> None:
    assert split_message("hello", 100) == ["hello"]


def test_prefers_paragraph_then_line_then_word_boundaries() -> None:
    para = "a" * 30 + "\n\n" + "b" * 30
    assert split_message(para, 40) == ["a" * 30 + "\n\n", "b" * 30]
    lines = "a" * 30 + "\n" + "b" * 30
    assert split_message(lines, 40) == ["a" * 30 + "\n", "b" * 30]
    words = "alpha beta gamma delta epsilon zeta eta theta"
    chunks = split_message(words, 20)
    assert all(len(c) <= 20 for c in chunks)
    assert "".join(chunks) == words
    assert all(c.endswith(" ") for c in chunks[:-1])  # cut after a space, not inside a word


def test_hard_cut_when_there_is_no_boundary() -> None:
    assert split_message("x" * 50, 20) == ["x" * 20, "x" * 20, "x" * 10]


def test_nine_thousand_characters_split_for_telegram_in_order() -> None:
    text = "\n\n".join(f"Paragraph {i}: " + "word " * 60 for i in range(30))
    assert len(text) > 9000
    chunks = split_message(text, 4096, utf16_len)
    assert len(chunks) == 3
    assert "".join(chunks) == text
    assert all(utf16_len(c) <= 4096 for c in chunks)


def test_code_fence_is_closed_and_reopened_across_chunks() -> None:
    code = "```\n" + "\n".join(f"line {i}" for i in range(40)) + "\n```\nafter"
    chunks = split_message(code, 100)
    assert len(chunks) > 1
    for chunk in chunks:
        assert chunk.count("```") % 2 == 0, chunk
    assert chunks[1].startswith("```\n")


def test_emoji_counted_as_two_utf16_units_are_never_split() -> None:
    text = "\U0001f600" * 30  # 60 UTF-16 units
    chunks = split_message(text, 20, utf16_len)
    assert all(utf16_len(c) <= 20 for c in chunks)
    assert "".join(chunks) == text


def test_limit_too_small_is_refused() -> None:
    with pytest.raises(ValueError):
        split_message("x", 4)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(["a", "b", " ", "\n", "\U0001f600", "é"]), min_size=0, max_size=600
    ),
    limit=st.integers(min_value=16, max_value=120),
    utf16=st.booleans(),
)
def test_chunks_fit_and_concatenate_to_the_input(text: str, limit: int, utf16: bool) -> None:
    count = utf16_len if utf16 else len
    chunks = split_message(text, limit, count)
    assert all(count(c) <= limit for c in chunks)
    assert "".join(chunks) == text
    assert all(c for c in chunks) or text == ""


@settings(max_examples=200, deadline=None)
@given(
    body=st.lists(st.text(alphabet="xy \n", max_size=30), min_size=1, max_size=30),
    limit=st.integers(min_value=24, max_value=100),
)
def test_fenced_code_chunks_each_have_balanced_fences(body: list[str], limit: int) -> None:
    text = "intro\n```\n" + "\n".join(body) + "\n```\noutro"
    chunks = split_message(text, limit)
    assert all(len(c) <= limit for c in chunks)
    assert all(c.count("```") % 2 == 0 for c in chunks)

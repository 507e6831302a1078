"""The pure parts of the context strategies: config of agent.context, token calibration, the
extractive condensed-turns summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config import TOOL_NAMES, AgentConfig, ConfigError, load_config
from gateway.context import condense
from gateway.context.strategy import SUMMARY_PREFIX, Loaded, Plan, prepare, too_large_text
from gateway.context.tokens import (
    MAX_FACTOR,
    MIN_FACTOR,
    STORE_CHANGE,
    UNCALIBRATED_FACTOR,
    Calibration,
    message_tokens,
    size_tokens,
    text_tokens,
)
from gateway.tools import BUILTIN_TOOLS
from gateway.tools.registry import Toolbox


def problems(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "hermes.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    return excinfo.value.problems


def test_context_defaults_and_the_window_cap(tmp_path: Path) -> None:
    path = tmp_path / "hermes.yaml"
    path.write_text("agent:\n  history_limit: 30\n  context:\n    max_messages: 50\n")
    agent = load_config(path).agent
    assert agent.context.strategy == "summary"
    assert Plan.from_config(agent).rows == 30  # history_limit is the hard cap
    window = agent.model_copy(
        update={
            "context": agent.context.model_copy(update={"strategy": "window", "max_messages": 12})
        }
    )
    assert Plan.from_config(window).rows == 12


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("agent:\n  context:\n    stratgy: window\n", "agent.context.stratgy"),
        ("agent:\n  context:\n    strategy: recent\n", "agent.context.strategy"),
        ("agent:\n  context:\n    target_ratio: 0.9\n", "agent.context.target_ratio"),
        ("agent:\n  context:\n    window_tokens: 10\n", "agent.context.window_tokens"),
    ],
)
def test_context_errors_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    [problem] = problems(tmp_path, text)
    assert problem.startswith(expected + ":"), problem


def test_calibration_goes_up_at_once_and_down_slowly() -> None:
    calibration = Calibration()
    assert calibration.factor("s") == UNCALIBRATED_FACTOR
    assert calibration.observe("s", 1000, 1500) == 1.5  # the model counts more: at once
    assert calibration.observe("s", 1000, 1000) == 1.25  # less: half way
    assert calibration.observe("s", 10, 500) == 1.25  # too small a sample: ignored
    assert calibration.observe("s", 1000, 100_000) == MAX_FACTOR
    for _ in range(20):
        calibration.observe("s", 1000, 1)
    assert calibration.factor("s") == MIN_FACTOR
    assert calibration.factor("other") == UNCALIBRATED_FACTOR


def test_calibration_is_bounded_in_sessions() -> None:
    calibration = Calibration(max_sessions=2)
    for sid in ("a", "b", "c"):
        calibration.observe(sid, 1000, 2000)
    assert [calibration.factor(s) for s in ("a", "b", "c")] == [UNCALIBRATED_FACTOR, 2.0, 2.0]


def test_extractive_summary_appends_and_stays_bounded() -> None:
    first = condense.extractive(None, [{"role": "user", "content": "hello there"}], 1000)
    assert first == "Recent condensed turns:\n- user: hello there"
    second = condense.extractive(first, [{"role": "assistant", "content": "hi"}], 1000)
    assert second.splitlines()[1:] == ["- user: hello there", "- assistant: hi"]
    many = [{"role": "user", "content": f"message {i} " + "x" * 50} for i in range(40)]
    bounded = condense.extractive(second, many, 600)
    assert len(bounded) <= 600
    lines = bounded.splitlines()
    assert lines[1].startswith("- (") and lines[1].endswith("earlier condensed turns omitted)")
    assert lines[-1].startswith("- user: message 39 ")  # the newest stay
    again = condense.extractive(bounded, many[:1], 600)
    omitted = int(again.splitlines()[1].split("(")[1].split()[0])
    assert omitted > int(lines[1].split("(")[1].split()[0])  # the count carries on


def test_extractive_summary_keeps_a_models_summary_and_the_focus() -> None:
    text = condense.extractive(
        "The user likes otters.",
        [
            {"role": "user", "content": "otters " + "y" * 300},
            {"role": "user", "content": "z" * 300},
        ],
        2000,
        focus="otters",
    )
    lines = text.splitlines()
    assert lines[0] == "The user likes otters."
    assert lines[1] == "(focus: otters)"
    assert len(lines[3]) > len(lines[4])  # the message on the focus keeps more of itself
    assert lines[4].endswith("...")


def test_a_history_that_fits_is_sent_whole_but_never_opens_with_an_orphan_tool_result() -> None:
    """The fast path (everything fits) must send what the unit walk would: a tool result
    whose call is older than the rows read is left out, the rest kept in order."""
    plan = Plan.from_config(AgentConfig())
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]}
    rows = (
        {"role": "tool", "tool_call_id": "t0", "content": "orphan"},
        {"role": "user", "content": "hi"},
        call,
        {"role": "tool", "tool_call_id": "t1", "content": "result"},
        {"role": "assistant", "content": "done"},
    )
    sent = prepare(plan, Loaded(messages=rows), system_prompt="sys", text="next").history
    assert sent == rows[1:]
    whole = prepare(plan, Loaded(messages=rows[1:]), system_prompt="sys", text="next")
    assert whole.history == rows[1:] and whole.dropped == 0


# --- token estimates of other scripts -------------------------------------------------------

CJK = "我们明天下午三点在火车站见面然后一起去博物馆看看新的展览" * 4  # 112 characters
CYRILLIC = "Встретимся завтра в три часа на вокзале и пойдём в музей" * 4
EMOJI = "🙂🎉🚀🌍" * 10


def test_cjk_is_estimated_at_about_a_token_a_character() -> None:
    """CJK costs about one token a character on the common vocabularies (a quarter of
    one is what four characters a token would say)."""
    assert text_tokens(CJK) >= 0.8 * len(CJK)
    assert text_tokens(CJK) <= 1.5 * len(CJK)
    assert message_tokens({"role": "user", "content": CJK}) >= 0.8 * len(CJK)


def test_other_scripts_and_emoji_are_not_undercounted() -> None:
    # Cyrillic: about 0.4-0.5 tokens a character on cl100k/o200k (spaces included).
    assert text_tokens(CYRILLIC) >= 0.4 * len(CYRILLIC)
    # Emoji: one to three tokens each.
    assert text_tokens(EMOJI) >= len(EMOJI)
    # Mixed text counts each part by its own script.
    mixed = "The station is 火车站 (vokzal: вокзал)."
    assert text_tokens(mixed) > text_tokens("The station is  (vokzal: ).")


def test_ascii_text_keeps_four_characters_a_token() -> None:
    assert text_tokens("a" * 400) == 100
    assert text_tokens("") == 0
    assert message_tokens({"role": "user", "content": "x" * 40}) == 4 + 10


def test_an_estimate_from_sizes_never_falls_below_the_texts() -> None:
    """The summarizer knows a history by its characters and UTF-8 bytes (SQL sums)."""
    for text in (CJK, CYRILLIC, EMOJI, "plain English text", CJK + " and English"):
        assert size_tokens(len(text), len(text.encode())) >= text_tokens(text)


def test_the_factor_to_store_moves_only_when_it_changed() -> None:
    calibration = Calibration()
    assert calibration.to_store("s", None) is None  # nothing learnt: nothing to store
    calibration.observe("s", 1000, 1500)
    assert calibration.to_store("s", None) == 1.5
    assert calibration.to_store("s", 1.5) is None
    calibration.observe("s", 1000, 1490)  # down half way: 1.495, within STORE_CHANGE
    assert calibration.to_store("s", 1.5) is None
    assert abs(calibration.factor("s") - 1.5) <= STORE_CHANGE * 1.5
    calibration.observe("s", 1000, 1000)
    assert calibration.to_store("s", 1.5) == calibration.factor("s") < 1.3
    # A stored factor is what a new process starts from; its own learning then wins.
    fresh = Calibration()
    fresh.restore("s", 1.7)
    assert fresh.factor("s") == 1.7
    fresh.restore("s", 1.2)
    assert fresh.factor("s") == 1.7
    fresh.restore("other", 99.0)
    assert fresh.factor("other") == MAX_FACTOR


# --- what follows the summary ---------------------------------------------------------------


def roles_after_summary(history: tuple[dict[str, object], ...]) -> list[object]:
    assert history[0]["role"] == "system"
    assert str(history[0]["content"]).startswith(SUMMARY_PREFIX)
    return [m["role"] for m in history[1:]]


def test_after_a_summary_the_history_opens_with_a_user_message() -> None:
    """A summary whose cut fell between a question and its answer: the answer is not
    sent without its question (system, summary, assistant is refused by several local
    models' chat templates)."""
    plan = Plan.from_config(AgentConfig())
    rows = (
        {"role": "assistant", "content": "the answer to a condensed question"},
        {"role": "user", "content": "next question"},
        {"role": "assistant", "content": "next answer"},
    )
    sent = prepare(plan, Loaded(messages=rows, summary="S"), system_prompt="sys", text="q")
    assert roles_after_summary(sent.history) == ["user", "assistant"]
    assert sent.history[1:] == rows[1:]
    assert sent.dropped == 1


def test_a_budget_cut_after_a_summary_opens_with_a_user_message_too() -> None:
    """The budget leaves room for the newest answer but not its question."""
    plan = Plan.from_config(AgentConfig(context={"window_tokens": 1024}))
    rows = (
        {"role": "user", "content": "old question"},
        {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "a long question " + "x" * 4000},
        {"role": "assistant", "content": "short answer"},
    )
    sent = prepare(plan, Loaded(messages=rows, summary="S"), system_prompt="sys", text="q")
    # Without the rule the cut keeps only "short answer": nothing is sent instead.
    assert roles_after_summary(sent.history) == []
    roomy = Plan.from_config(AgentConfig(context={"window_tokens": 4096}))
    sent = prepare(roomy, Loaded(messages=rows, summary="S"), system_prompt="sys", text="q")
    assert roles_after_summary(sent.history) == ["user", "assistant", "user", "assistant"]
    tool_call = (
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]},
        {"role": "tool", "tool_call_id": "t1", "content": "result"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "then this"},
    )
    sent = prepare(plan, Loaded(messages=tool_call, summary="S"), system_prompt="s", text="q")
    assert roles_after_summary(sent.history) == ["user", "assistant"]


def test_a_summary_of_cjk_text_is_bounded_in_tokens_not_only_characters() -> None:
    """A bound of 600 characters is 150 estimated tokens of ASCII text: a summary of
    CJK messages is held to as many tokens, not to 600 characters (about 600 tokens)."""
    many = [{"role": "user", "content": f"{n}: {CJK}"} for n in range(30)]
    bounded = condense.extractive(None, many, 600)
    assert text_tokens(bounded) <= 600 // 4
    assert bounded.splitlines()[-1].startswith("- user: 29: ")  # the newest stay
    head = condense.extractive(CJK * 10, many[:1], 600)  # a model's long summary, clipped
    assert text_tokens(head) <= 600 // 4 and head.endswith("...")
    english = condense.extractive(None, [{"role": "user", "content": "x" * 100}] * 30, 600)
    assert 600 - 120 < len(english) <= 600  # ASCII: bounded in characters as before


# --- what every request carries ----------------------------------------------------------


def test_the_tool_specs_and_the_message_are_counted_in_what_is_sent() -> None:
    """`sent_tokens` (what calibration compares with the model's count) is everything
    the request carries, the tool specs included; the history gets what they leave."""
    plan = Plan.from_config(AgentConfig(context={"window_tokens": 2048}))
    rows = tuple(
        {"role": role, "content": f"{role} {n} " + "w" * 200}
        for n in range(20)
        for role in ("user", "assistant")
    )
    bare = prepare(plan, Loaded(messages=rows), system_prompt="sys", text="q")
    tools = prepare(plan, Loaded(messages=rows), system_prompt="sys", text="q", tools_tokens=900)
    assert tools.base_tokens == bare.base_tokens + 900
    history = sum(message_tokens(m) for m in tools.history)
    assert tools.sent_tokens == tools.base_tokens + history + message_tokens({"content": "q"})
    assert tools.sent_tokens <= plan.budget
    assert len(tools.history) < len(bare.history)  # the specs took history's room


def test_a_message_that_alone_outgrows_the_window_is_too_large() -> None:
    plan = Plan.from_config(AgentConfig(context={"window_tokens": 1024}))
    fits = prepare(plan, Loaded(), system_prompt="sys", text="x" * 3000)
    assert not fits.too_large
    big = prepare(plan, Loaded(), system_prompt="sys", text="x" * 3000, factor=1.5)
    assert big.too_large and big.history == ()
    notice = too_large_text(plan, big)
    assert "about 1,131 tokens" in notice and "window of 1,024 tokens" in notice
    tools = prepare(plan, Loaded(), system_prompt="sys", text="hi", tools_tokens=2000)
    assert tools.too_large
    assert too_large_text(plan, tools).startswith("This agent cannot answer")


def test_a_summary_too_long_for_what_the_rest_leaves_is_cut_to_fit() -> None:
    plan = Plan.from_config(AgentConfig(context={"window_tokens": 1024}))
    loaded = Loaded(summary="s" * 4000)
    sent = prepare(plan, loaded, system_prompt="sys", text="q", tools_tokens=300)
    assert sent.sent_tokens <= plan.budget
    assert sent.history[0]["content"].startswith(SUMMARY_PREFIX + "sss")


def test_the_toolbox_counts_its_specs_as_a_request_carries_them() -> None:
    box = Toolbox(BUILTIN_TOOLS, list(TOOL_NAMES))
    assert box.spec_tokens == text_tokens(json.dumps(box.specs())) > 1000
    assert Toolbox(BUILTIN_TOOLS, []).spec_tokens == 0

"""The pure parts of issue 15: config of agent.context, token calibration, the
extractive condensed-turns summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import AgentConfig, ConfigError, load_config
from gateway.context import condense
from gateway.context.strategy import Loaded, Plan, prepare
from gateway.context.tokens import MAX_FACTOR, MIN_FACTOR, Calibration


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
    assert calibration.factor("s") == 1.0
    assert calibration.observe("s", 1000, 1500) == 1.5  # the model counts more: at once
    assert calibration.observe("s", 1000, 1000) == 1.25  # less: half way
    assert calibration.observe("s", 10, 500) == 1.25  # too small a sample: ignored
    assert calibration.observe("s", 1000, 100_000) == MAX_FACTOR
    for _ in range(20):
        calibration.observe("s", 1000, 1)
    assert calibration.factor("s") == MIN_FACTOR
    assert calibration.factor("other") == 1.0


def test_calibration_is_bounded_in_sessions() -> None:
    calibration = Calibration(max_sessions=2)
    for sid in ("a", "b", "c"):
        calibration.observe(sid, 1000, 2000)
    assert [calibration.factor(s) for s in ("a", "b", "c")] == [1.0, 2.0, 2.0]


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

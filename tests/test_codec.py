"""gateway.store.codec: orjson where it can, the standard library where orjson refuses."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from gateway.store import codec

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(JSON_VALUES)
def test_both_ways_agree_with_the_standard_library(value: object) -> None:
    text = codec.dumps(value)
    assert json.loads(text) == value
    assert codec.loads(json.dumps(value)) == value
    assert codec.loads(text) == value


def test_values_orjson_refuses_still_encode() -> None:
    huge = {"id": 2**70, "by_number": {1: "one"}}
    text = codec.dumps(huge)
    assert json.loads(text) == {"id": 2**70, "by_number": {"1": "one"}}


def test_texts_the_standard_library_wrote_still_decode() -> None:
    # json.dumps writes NaN/Infinity literals, which orjson refuses to read.
    decoded = codec.loads(json.dumps({"cost": float("nan"), "cap": float("inf")}))
    assert math.isnan(decoded["cost"]) and decoded["cap"] == float("inf")


def test_non_ascii_is_kept_as_is() -> None:
    assert codec.dumps({"t": "héllo 👋"}) == '{"t":"héllo 👋"}'


def test_default_applies_to_unknown_objects() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    assert json.loads(codec.dumps({"x": Odd()}, default=str)) == {"x": "odd"}

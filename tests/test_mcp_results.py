"""A tool server's answer as the model reads it (gateway.mcp.results): text as is,
structured content as JSON (not twice), images apart, long answers cut with a marker."""

from __future__ import annotations

import base64
import json

import mcp_types as types

from gateway.mcp.answers import to_result
from gateway.mcp.results import cut


def answer(*content: object, structured: dict | None = None, error: bool = False):
    return types.CallToolResult(
        content=list(content), structured_content=structured, is_error=error
    )


def test_text_blocks_are_given_as_they_are() -> None:
    result = to_result(answer(types.TextContent(type="text", text="a\nb")), 100)
    assert (result.text, result.images, result.is_error) == ("a\nb", (), False)


def test_structured_content_alone_becomes_json() -> None:
    result = to_result(answer(structured={"n": 1, "s": "é"}), 100)
    assert json.loads(result.text) == {"n": 1, "s": "é"}


def test_structured_content_that_the_text_already_says_is_not_repeated() -> None:
    pretty = json.dumps({"n": 1}, indent=2)
    same = to_result(answer(types.TextContent(type="text", text=pretty), structured={"n": 1}), 100)
    assert same.text == pretty
    wrapped = answer(types.TextContent(type="text", text="3"), structured={"result": 3})
    assert to_result(wrapped, 100).text == "3"
    other = answer(types.TextContent(type="text", text="see data"), structured={"n": 1})
    assert to_result(other, 100).text == 'see data\n{"n": 1}'


def test_images_are_kept_apart_and_bad_ones_noted() -> None:
    png = b"\x89PNG fake"
    good = types.ImageContent(
        type="image", data=base64.b64encode(png).decode(), mime_type="image/png"
    )
    bad = types.ImageContent(type="image", data="not base64!", mime_type="image/jpeg")
    result = to_result(answer(good, bad), 1000)
    assert result.images == (("image/png", png),)
    assert "image/jpeg" in result.text


def test_an_error_result_stays_an_error() -> None:
    result = to_result(answer(types.TextContent(type="text", text="no"), error=True), 100)
    assert result.is_error and result.text == "no"


def test_a_long_answer_is_cut_to_the_limit_with_a_marker() -> None:
    text = cut("x" * 5000, 200)
    assert len(text) <= 200
    kept = text.index("\n")
    assert text[:kept] == "x" * kept
    assert text.endswith(f"[cut: 5,000 characters, the first {kept} shown]")
    assert cut("short", 200) == "short"

"""The two admission checks every front end shares: `Range` (a number within the width it
is stored in) and `check_json_text` (every string valid Unicode), with exact messages."""

import math
import re

import pytest

from jaxllm.unicode_text import check_json_text, check_text
from jaxllm.value_ranges import FLOAT32_MAX, INT32_MAX, Range


@pytest.mark.parametrize("allowed, value, inside", [
    (Range(0, INT32_MAX), INT32_MAX, True), (Range(0, INT32_MAX), INT32_MAX + 1, False),
    (Range(0, INT32_MAX), -1, False), (Range(0.0, 1.0, low_open=True), 0.0, False),
    (Range(0.0, 1.0, low_open=True), 5e-324, True), (Range(0.0, FLOAT32_MAX), math.inf, False),
    (Range(0.0, FLOAT32_MAX), math.nan, False), (Range(0.0, FLOAT32_MAX), 10**400, False),
    (Range(-2.0, 2.0), -0.0, True),
])
def test_range_membership_compares_without_converting(allowed, value, inside):
    assert (value in allowed) is inside


def test_range_messages_name_the_parameter_and_the_range():
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0.0, 1.0], got 0.0.")) as e:
        Range(0.0, 1.0, low_open=True).check("top_p", 0.0)
    assert e.value.param == "top_p"  # the server's error JSON states it
    # Python refuses to print an int of over 4300 digits: it is described by its size.
    with pytest.raises(ValueError, match=re.escape("seed must be in [0, 1], got an int of "
                                                   "33220 bits.")):
        Range(0, 1).check("seed", 10**10000)


def test_check_text_reports_the_first_lone_surrogate_escaped():
    check_text("héllo \U0001F600", "prompt")  # any valid text passes, astral planes included
    with pytest.raises(ValueError, match=re.escape(
            "prompt is not valid Unicode text: it holds the lone surrogate '\\udc80' at "
            "character 2")):
        check_text("ab\udc80\ud800", "prompt")


@pytest.mark.parametrize("value, message", [
    ({"a": [1, {"b": "ok"}, {"c": "x\ud800"}]}, "body.a[2].c is not valid"),
    ({"a": "ok", "b": ["\ud800", "\udfff"]}, "body.b[0] is not valid"),
    ({"ok": 1, "\ud800": 2}, "a key of body is not valid"),
])
def test_check_json_text_names_the_path_of_the_first_bad_string(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_json_text(value, "body")


def test_check_json_text_walks_any_depth_without_recursion():
    deep: list = ["\ud800"]
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(ValueError, match=re.escape("body" + "[0]" * 10_001 + " is not")):
        check_json_text(deep, "body")

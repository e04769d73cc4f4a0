"""What the proxy accepts from a client is what the audit log can hold: the first fault in document order is named,
and a body without one passes, whichever of the two walks decides."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.serving.recordable import MAX_DEPTH, SAFE_INT, Unrecordable, check_recordable
from proxy.serving.recordable import _check_each as check_each
from proxy.serving.recordable import _plainly_recordable as plainly_recordable


def nested(containers: int) -> Any:
    """`containers` levels of nesting, objects and lists by turns."""
    value: Any = "leaf"
    for level in range(containers):
        value = {"a": value} if level % 2 else [value]
    return value


@pytest.mark.parametrize(
    ("body", "path", "says"),
    [
        ({"n": SAFE_INT + 1}, "n", "beyond the integers"),
        ({"n": [1, -SAFE_INT - 1]}, "n[1]", "beyond the integers"),
        ({"x": math.inf}, "x", "infinity"),
        ({"x": {"y": math.nan}}, "x.y", "infinity"),
        ({"messages": [{"content": "ok \ud800"}]}, "messages[0].content", "lone surrogate"),
        ({"k\udfff": 1}, "k\\udfff", "lone surrogate"),
        ({"first": math.inf, "second": SAFE_INT + 1}, "first", "infinity"),
    ],
)
def test_the_first_fault_is_named_by_its_path(body: dict[str, Any], path: str, says: str) -> None:
    with pytest.raises(Unrecordable) as refused:
        check_recordable(body)
    assert refused.value.path == path
    assert says in refused.value.reason


def test_nesting_is_bounded_and_the_bound_itself_passes() -> None:
    check_recordable(nested(MAX_DEPTH))
    with pytest.raises(Unrecordable, match="nested deeper than 64 levels"):
        check_recordable(nested(MAX_DEPTH + 1))
    assert plainly_recordable(nested(MAX_DEPTH), MAX_DEPTH)
    assert not plainly_recordable(nested(MAX_DEPTH + 1), MAX_DEPTH)


def test_everyday_bodies_pass_with_text_in_any_script() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "héllo, 你好, 🎉"}],
        "temperature": 0.7,
        "max_tokens": SAFE_INT,
        "stop": None,
        "stream": False,
        "metadata": {"ключ": -SAFE_INT},
    }
    assert plainly_recordable(body, MAX_DEPTH)
    check_recordable(body)


JSON_LIKE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=6),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(st.characters(exclude_categories=()), max_size=4), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(JSON_LIKE, st.integers(min_value=1, max_value=6))
def test_the_quick_walk_never_vouches_for_a_value_the_full_walk_refuses(value: Any, depth: int) -> None:
    """The quick walk may be unsure of a value (then the full one decides); it may never pass a fault."""
    if plainly_recordable(value, depth):
        check_each(value, depth)

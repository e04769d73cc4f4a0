"""Specification of pinned_backend.textstream: releasing text safely around stop strings and partial characters."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pinned_backend.textstream import StopTextStream


def feed(stream: StopTextStream, text: str) -> str:
    """Hand the text over one character at a time, as growing prefixes, and collect what is released."""
    out = "".join(stream.update(text[:i]) for i in range(1, len(text) + 1))
    return out + stream.finish()


def test_without_stop_strings_everything_is_released_as_it_comes() -> None:
    stream = StopTextStream(())
    assert stream.update("Hel") == "Hel"
    assert stream.update("Hello") == "lo"
    assert stream.finish() == ""


def test_text_that_may_begin_a_stop_string_is_held_back() -> None:
    stream = StopTextStream(["END"])
    assert stream.update("abc E") == "abc "
    assert stream.update("abc EN") == ""
    assert stream.update("abc ENx") == "ENx"


def test_a_stop_string_cuts_the_text_before_it_and_ends_the_stream() -> None:
    stream = StopTextStream(["\n\n", "END"])
    assert stream.update("one E") == "one "
    assert stream.update("one END two") == ""
    assert stream.stopped
    assert stream.update("one END two three") == ""
    assert stream.finish() == ""
    assert stream.sent == "one "


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert feed(StopTextStream(["b", "a"]), "xxab") == "xx"


def test_a_trailing_partial_character_waits_for_its_last_byte() -> None:
    stream = StopTextStream(())
    assert stream.update("caf\ufffd") == "caf"
    assert stream.update("café") == "é"


def test_finish_releases_what_was_held() -> None:
    stream = StopTextStream(["STOP"])
    assert stream.update("go ST") == "go "
    assert stream.finish() == "ST"


@given(text=st.text(alphabet="abc \n", max_size=40), stops=st.lists(st.text("abc", min_size=1, max_size=3)))
@settings(max_examples=200, deadline=None)
def test_released_text_is_the_text_up_to_the_first_stop(text: str, stops: list[str]) -> None:
    cuts = [text.find(s) for s in stops if s in text]
    expected = text[: min(cuts)] if cuts else text
    # A stop string can only be found once the text reaching it has arrived; prefixes reveal them in order.
    first_seen = min(
        (i for i in range(1, len(text) + 1) if any(s in text[:i] for s in stops)),
        default=None,
    )
    if first_seen is not None:
        prefix = text[:first_seen]
        expected = prefix[: min(prefix.find(s) for s in stops if s in prefix)]
    assert feed(StopTextStream(stops), text) == expected

"""Progress on stderr: a redrawn bar on a terminal, plain lines anywhere else, at most every interval and at the end."""

from __future__ import annotations

import io
import os

from proxy.commands.progress import Bar, Lines, progress_on


def test_a_terminal_gets_a_bar_and_anything_else_plain_lines() -> None:
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        bar = progress_on(terminal, 3, "study")
        assert isinstance(bar, Bar)
        bar.advance("c1, side a")
        bar.close()
    os.close(leader)
    assert isinstance(progress_on(io.StringIO(), 3, "study"), Lines)


def test_lines_come_at_most_every_interval_and_at_the_end_with_rate_and_time_left() -> None:
    now = [0.0]
    out = io.StringIO()
    lines = Lines(out, 4, "study st-1", interval_s=10, clock=lambda: now[0])
    for moment in (1.0, 2.0, 12.0):
        now[0] = moment
        lines.advance("c8+b4, side b")
    assert out.getvalue() == "study st-1: 3/4 (75%) at c8+b4, side b; 0.2 req/s, about 4 s left\n"
    now[0] = 13.0
    lines.advance("c8+b4, side b")
    lines.close()
    assert out.getvalue().splitlines()[-1] == "study st-1: 4/4 (100%) at c8+b4, side b; 0.3 req/s"


def test_an_interrupted_run_says_where_it_stopped() -> None:
    out = io.StringIO()
    now = [0.0]
    lines = Lines(out, 100, "study", interval_s=60, clock=lambda: now[0])
    now[0] = 5.0
    lines.advance("c1, side a")
    lines.close()
    assert out.getvalue() == "study: 1/100 (1%) at c1, side a; 0.2 req/s\n", (
        "no guess of the time left from one"
    )

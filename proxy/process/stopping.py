"""How `stackpin serve` answers SIGINT and SIGTERM, the same in one process and in the supervisor of several.

Before serving begins nothing is in flight, so a signal cancels the start at once (a model may be loading); once
serving, it asks for a stop in order, so that requests in flight finish and streams close with their records.
"""

from __future__ import annotations

import asyncio
import signal


class Stopping:
    """Installed on the running loop for the task that creates it."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._serving = False
        self.requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.signal)

    def serving(self) -> None:
        """From now on a signal stops in order."""
        self._serving = True

    def signal(self) -> None:
        if self._serving:
            self.requested.set()
        else:
            self._task.cancel()

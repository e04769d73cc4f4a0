"""The engine's worker thread: runs `Engine.step()` while there is work and sleeps when there is none.

An asyncio server calls `submit` and `cancel` from its event loop; the steps run here, so the loop stays
responsive while the model computes. The steps run best on the thread that loaded the model: PyTorch's OpenMP
workers belong to the first thread that ran a parallel op, and a second thread's parallel ops run 2-3x slower on
the CPU while the first one's workers exist, so the server loads and steps on one single-thread executor. A step that raises fails the requests it held and the thread carries on.
Chores (an embeddings job) run here too, one turn between two steps, so that they use the model and its cache
on the one thread that owns them. It knows nothing of scheduling (engine.py) or of HTTP.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Protocol

from pinned_backend.engine import Engine, EngineError, EngineStopped, Sink
from pinned_backend.sampling import SamplingParams


class Chore(Protocol):
    """Work for the engine's thread that is not a request of the engine's own."""

    def advance(self) -> bool:
        """One bounded piece of the work (one forward pass); True once it is finished."""
        ...

    def fail(self, error: EngineError) -> None: ...


class EngineRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Condition()  # also guards _chores
        self._stopping = False
        self._chores: deque[Chore] = deque()
        self._thread = threading.Thread(target=self._loop, name="stackpin-engine", daemon=True)
        self._on_executor: Future[None] | None = None

    def start(self, executor: Executor | None = None) -> None:
        """Step on a thread of the runner's own, or on `executor`'s (one thread, the one that loaded the model)."""
        if executor is None:
            self._thread.start()
        else:
            self._on_executor = executor.submit(self._loop)

    @property
    def alive(self) -> bool:
        if self._on_executor is not None:
            return not self._on_executor.done()
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._on_executor is not None:
            self._on_executor.result()
        elif self._thread.is_alive():
            self._thread.join()
        stopped = EngineStopped("the server is shutting down")
        self.engine.abort_all(stopped)
        with self._wake:
            chores, self._chores = list(self._chores), deque()
        for chore in chores:
            chore.fail(stopped)

    def add_chore(self, chore: Chore) -> None:
        with self._wake:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._chores.append(chore)
            self._wake.notify()

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink) -> None:
        self.engine.submit(request_id, prompt_ids, params, sink)
        with self._wake:
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.has_work() and not self._chores:
                    self._wake.wait()
                if self._stopping:
                    return
                chore = self._chores[0] if self._chores else None
            if self.engine.has_work():
                try:
                    self.engine.step()
                except Exception as exc:  # a failed step must fail its requests, not kill the server
                    self.engine.abort_all(
                        EngineError(f"the engine failed a step: {type(exc).__name__}: {exc}")
                    )
            if chore is not None:
                self._turn(chore)

    def _turn(self, chore: Chore) -> None:
        try:
            finished = chore.advance()
        except Exception as exc:
            chore.fail(EngineError(f"the engine failed a pass: {type(exc).__name__}: {exc}"))
            finished = True
        # A chore that waits for cache room waits only on the engine's running requests, which the next step
        # moves on; with none running, every block is free.
        if finished:
            with self._wake:
                self._chores.remove(chore)

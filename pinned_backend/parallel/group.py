"""Starting a tensor-parallel group: rank 0 is the serving process; ranks 1..N-1 are processes it starts, each
`python -m pinned_backend.parallel.worker`, joined through a file store in a private folder.

Each group is a process group of its own (gloo on the CPU, NCCL on GPUs, rank r on device cuda:r), never
torch.distributed's global default, so that one process may hold several. A worker that cannot start, or that
exits, makes rank 0's next collective fail (its connection closes) rather than hang: rank 0 then fails the step's
requests and says which rank is gone.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pinned_backend.parallel.combine import ProcessGroupComm

# How long a rank waits for the others to join, and for any one collective but the wait for the next step: a worker
# loads the whole checkpoint before it cuts its shard, which can take minutes for a large model.
JOIN_TIMEOUT = timedelta(minutes=15)
_STOP_WAIT_S = 10.0
_JOIN_POLL_S = 0.1


def device_of(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU for every rank, or one GPU each."""
    return device if device.type == "cpu" else torch.device("cuda", rank)


def join(store_path: Path, workers: Workers, device: torch.device) -> ProcessGroupComm:
    """Rank 0 joins the group: returns once every worker has joined, or raises RuntimeError as soon as one exits
    before it does."""
    joined: list[ProcessGroupComm] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            joined.append(connect(store_path, 0, len(workers.processes) + 1, device))
        except BaseException as e:  # handed to the waiting thread
            errors.append(e)

    thread = threading.Thread(target=run, name="stackpin-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_JOIN_POLL_S)
        if gone := workers.gone():
            raise RuntimeError(
                f"tensor-parallel rank {gone[0]} exited (code {workers.processes[gone[0] - 1].returncode}) "
                "before the group formed; its error is above"
            )
    if errors:
        raise errors[0]
    return joined[0]


def connect(
    store_path: Path, rank: int, size: int, device: torch.device, timeout: timedelta = JOIN_TIMEOUT
) -> ProcessGroupComm:
    """Join the group whose store is `store_path` as `rank` of `size`; returns once every rank has joined.
    `timeout` bounds the joining and each collective but a rank's wait for the next step (`broadcast(idle=True)`)."""
    store = dist.FileStore(str(store_path), size)
    group: dist.ProcessGroup
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return ProcessGroupComm(group, rank, size)


@dataclass
class Workers:
    """Ranks 1..N-1, as processes, and the folder their store lives in."""

    processes: list[subprocess.Popen[bytes]]
    folder: tempfile.TemporaryDirectory[str]
    stopped: bool = field(default=False)

    def gone(self) -> list[int]:
        """The ranks whose process has exited."""
        return [rank for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]

    def kill(self) -> None:
        """End every worker now (rank 0 failed to start)."""
        for process in self.processes:
            process.kill()
        self.stop()

    def stop(self) -> None:
        """Wait for the workers to leave (they do once rank 0 says stop), ending any that does not."""
        if self.stopped:
            return
        self.stopped = True
        for process in self.processes:
            try:
                process.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.folder.cleanup()


def start_workers(settings_json: str, degree: int) -> tuple[Workers, Path]:
    """Start ranks 1..degree-1 with the backend's settings; returns them and the store rank 0 joins too."""
    folder = tempfile.TemporaryDirectory(prefix="stackpin-tp-")
    store = Path(folder.name) / "store"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "pinned_backend.parallel.worker", str(store), str(rank), str(degree)],
            stdin=subprocess.PIPE,
        )
        for rank in range(1, degree)
    ]
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(settings_json.encode())
        process.stdin.close()
    return Workers(processes, folder), store

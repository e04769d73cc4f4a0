"""C kernels of this folder, built with the machine's C compiler the first time they are needed and kept on disk.

A library is built from one source file with OpenMP and without any licence to reorder float arithmetic
(`-ffp-contract=off`, no `-ffast-math`), so its bits follow from the source alone: the instruction set it is tuned
for (`-march=native`) changes its speed, never its results. Its file is named by a digest of the source, the
compiler's version, the flags and the CPU it was tuned for, so a changed source or another machine sharing the cache
builds anew; a build goes to a temporary file renamed into place, so processes building side by side never load a
half-written library.

OpenMP comes from the libgomp that torch has loaded already (the same soname), so a kernel's threads are torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any library here asks for one)

SOURCES = Path(__file__).resolve().parent
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fPIC",
    "-shared",
    "-std=gnu11",
)
BUILD_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """A kernel library could not be built or loaded; the message says why and what to install."""


@dataclass(frozen=True)
class Built:
    library: ctypes.CDLL
    path: Path


def compiler() -> str:
    """The C compiler: $CC, else `cc`."""
    return os.environ.get("CC") or "cc"


def cache_dir() -> Path:
    """Where built libraries are kept: $STACKPIN_KERNEL_CACHE, else stackpin/kernels in the user's cache folder."""
    if os.environ.get("STACKPIN_KERNEL_CACHE"):
        return Path(os.environ["STACKPIN_KERNEL_CACHE"])
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError as error:  # no HOME and no passwd entry
        raise BuildError(
            f"no folder to keep built kernels in ({error}); set STACKPIN_KERNEL_CACHE"
        ) from error
    return base / "stackpin" / "kernels"


def build(source: Path) -> Built:
    """The library of the C file `source`, built here if no kept one matches; a BuildError when there is no compiler
    or it fails."""
    source_name = source.name
    cc = shutil.which(compiler())
    if cc is None:
        raise BuildError(
            f"no C compiler: `{compiler()}` is not on PATH; install gcc (or set CC) to build {source_name}"
        )
    version = _compiler_version(cc)
    digest = hashlib.sha256()
    for part in (source.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_identity().encode()):
        digest.update(hashlib.sha256(part).digest())
    target = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                partial = Path(scratch) / target.name
                done = _run([cc, *FLAGS, "-o", str(partial), str(source), "-lm"])
                if done.returncode != 0:
                    raise BuildError(f"building {source_name} with {cc} failed:\n{done.stderr.strip()}")
                os.replace(partial, target)
        except OSError as error:
            raise BuildError(
                f"cannot keep the built {source_name} in {target.parent} ({error}); set STACKPIN_KERNEL_CACHE to a "
                "writable folder"
            ) from error
    try:
        return Built(ctypes.CDLL(str(target)), target)
    except OSError as error:
        raise BuildError(f"loading the built {source_name} ({target}) failed: {error}") from error


@functools.cache
def _compiler_version(cc: str) -> str:
    """The first line of `cc --version`, once a process for each compiler (every kernel set made asks)."""
    return (_run([cc, "--version"]).stdout.splitlines() or [""])[0]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise BuildError(f"running {command[0]} failed: {error}") from error


def _cpu_identity() -> str:
    """What -march=native tunes for: the machine and its CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join([platform.machine(), *dict.fromkeys(wanted)])

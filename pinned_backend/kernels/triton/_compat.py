"""Triton where it is installed, and a stand-in where it is not.

The kernel modules import `triton` and `tl` from here, so that a machine without Triton (CI, the CPU backend) can
still import them, read their launch configurations and collect their tests; only launching a kernel needs the real
thing. Every kernel module uses `from __future__ import annotations`, so `tl.constexpr` in a signature is never
evaluated on such a machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ModuleNotFoundError:
    HAVE_TRITON = False

    class _Unlaunchable:
        """What `@triton.jit` gives without Triton: a kernel that says why it cannot run."""

        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn

        def __getitem__(self, grid: object) -> Callable[..., Any]:
            raise RuntimeError(f"{self.fn.__name__} needs Triton and a CUDA device; Triton is not installed")

    def _jit(fn: Callable[..., Any] | None = None, **options: object) -> Any:
        if fn is None:
            return _Unlaunchable
        return _Unlaunchable(fn)

    triton = SimpleNamespace(jit=_jit)  # type: ignore[assignment]
    tl = SimpleNamespace()  # type: ignore[assignment]


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter, on the CPU (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


__all__ = ["HAVE_TRITON", "interpreted", "tl", "triton"]

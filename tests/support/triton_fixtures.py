"""Fixtures of the GPU kernels' tests: the Triton kernels package, and memory that shows an element no program
wrote. torch and Triton are imported only when a test asks for one."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def triton_ops() -> ModuleType:
    """The Triton kernels package, on a machine with Triton and a CUDA device; the test is skipped elsewhere."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return importlib.import_module("pinned_backend.kernels.triton")


@pytest.fixture
def unwritten_elements_show(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matmul's `torch.empty` hands out memory filled with NaN, so that an element no program writes shows (the
    caching allocator would otherwise hand back the previous call's block, holding the very bits expected)."""
    torch = pytest.importorskip("torch")

    class NanTorch:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def empty(*args: Any, **kwargs: Any) -> Any:
            return torch.empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(importlib.import_module("pinned_backend.kernels.triton.matmul"), "torch", NanTorch())

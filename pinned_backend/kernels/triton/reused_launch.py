"""Launching a Triton kernel again without Triton's per-call binding.

`kernel[grid](*args)` binds every argument, specialises it and builds a cache key on every call: on the H200's host
a matmul launch took some 36 us against 18 for cuBLAS's, and an eager step of one 512-token
prompt, about 300 launches, waits on its host. `ReusedLaunch` goes through Triton once per specialisation, which
compiles or finds the kernel, and launches that compiled kernel directly afterwards.

Its key must hold everything Triton specialises a compiled kernel on, for the kinds of argument our kernels pass:
a tensor's dtype, device and 16-byte alignment; an int's width (32 or 64 bits), whether it is 1 and whether it is
divisible by 16 (the last two for every int, which is never less than Triton distinguishes); None; the constexprs'
values; and the launch options. Anything else (a tensor descriptor, a float) takes Triton's own path every time, as
does every launch while a launch hook (a profiler) is installed, so that the hook sees it, and under Triton's
interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._compat import HAVE_TRITON, interpreted

if HAVE_TRITON:
    from triton import knobs
    from triton.runtime import driver

_INT32 = range(-(1 << 31), 1 << 31)


def _specialisation(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return (value in _INT32, value == 1, value % 16 == 0)
    raise _Unkeyed


def _hooked() -> bool:
    # Triton keeps launch hooks in chains (empty unless a profiler adds one); older versions held one or None.
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)


class _Unkeyed(Exception):
    """An argument whose specialisation this module does not reproduce."""


class ReusedLaunch:
    """Launches `kernel`, a `@triton.jit` function whose runtime arguments all come before its constexprs, and which
    is always given its constexprs by name in the order it declares them."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple[object, ...], Any] = {}
        # Triton reads TRITON_INTERPRET when a kernel is decorated: an interpreted kernel stays interpreted.
        self.interpreted = interpreted()
        params = getattr(kernel, "params", [])
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        kinds = [p.is_constexpr for p in params]
        if kinds != sorted(kinds):
            raise ValueError(f"{kernel}: a reused launch needs every runtime argument before the constexprs")

    def __call__(
        self,
        grid: Sequence[int],
        args: Sequence[object],
        constexprs: dict[str, object],
        **options: Any,
    ) -> None:
        if self.interpreted or _hooked():
            self._through_triton(grid, args, constexprs, options)
            return
        device = driver.active.get_current_device()
        try:
            key = (
                device,
                tuple(_specialisation(a) for a in args),
                tuple(constexprs.values()),
                tuple(options.items()),
            )
        except _Unkeyed:
            self._through_triton(grid, args, constexprs, options)
            return
        compiled = self.compiled.get(key)
        if compiled is None:
            if list(constexprs) != self.constexpr_names:
                raise ValueError(
                    f"constexprs {list(constexprs)}: {self.kernel} declares {self.constexpr_names}"
                )
            # Triton's own path compiles (or loads) the kernel for this specialisation, and launches it.
            compiled = self._through_triton(grid, args, constexprs, options)
            if hasattr(compiled, "packed_metadata"):
                self.compiled[key] = compiled
            return
        gx, gy, gz = (*grid, 1, 1)[:3]
        # What Triton's own launch passes, less the launch metadata that only a launch hook reads.
        compiled.run(
            gx,
            gy,
            gz,
            driver.active.get_current_stream(device),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *constexprs.values(),
        )

    def _through_triton(
        self,
        grid: Sequence[int],
        args: Sequence[object],
        constexprs: dict[str, object],
        options: dict[str, Any],
    ) -> Any:
        return self.kernel[tuple(grid)](*args, **constexprs, **options)

"""What a kernel derives from one step's index tensors, computed at the step's first layer and reused by the rest.

Every layer of a step passes the kernels the same positions, sequence ids and block tables; what the CPU kernels
derive from them (an attention's tile plan and masks, the rotary rows of the step's positions) is the same at every
layer, and on the CPU each small op that derives it costs microseconds of Python and dispatch. A `StepMemo` keeps
those values with a copy of the tensors they came from, and hands them out again while equal tensors come back
(compared element for element: identity would not do, since a caller may refill one buffer step after step, and
the model's own index tensors, made under inference mode, have no version counter to say they changed). A value is
a function of the tensors' contents and the key alone, so reusing it changes no bit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class StepMemo:
    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._values: dict[Hashable, Any] = {}

    def get(self, tensors: tuple[torch.Tensor, ...], key: Hashable, make: Callable[[], T]) -> T:
        """The value under `key` derived from `tensors`, made by `make` unless equal tensors already made it."""
        same = len(tensors) == len(self._tensors) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(tensors, self._tensors, strict=True)
        )
        if not same:
            self._tensors = tuple(t.clone() for t in tensors)
            self._values = {}
        if key not in self._values:
            self._values[key] = make()
        value: T = self._values[key]
        return value

"""The CPU kernel sets' compiled kernels, built together: the attention (cpu_paged_attention) and a layer's per-row
ops (cpu_layer_ops). Both or neither serve, so a set's bits are those of one of two named configurations: "compiled",
or "torch" where no C compiler builds them (the torch ops then serve, with other bits)."""

from __future__ import annotations

from dataclasses import dataclass

from pinned_backend.kernels import native
from pinned_backend.kernels.cpu_layer_ops import CompiledLayerOps
from pinned_backend.kernels.cpu_paged_attention import CompiledAttention


@dataclass(frozen=True)
class CompiledKernels:
    attention: CompiledAttention | None
    layer_ops: CompiledLayerOps | None
    unbuilt: str  # why they are None; "" when built

    @property
    def name(self) -> str:
        """How the stack names the configuration."""
        return "torch" if self.attention is None else "compiled"


NOT_COMPILED = CompiledKernels(None, None, "the torch ops were asked for")


def compiled_kernels(chunk: int, *, wanted: bool = True) -> CompiledKernels:
    """The compiled kernels with the attention's keys in chunks of `chunk` tokens; none where not `wanted` or where
    they do not build (`unbuilt` says why)."""
    if not wanted:
        return NOT_COMPILED
    try:
        return CompiledKernels(CompiledAttention.load(chunk), CompiledLayerOps.load(), "")
    except native.BuildError as error:
        return CompiledKernels(None, None, str(error))

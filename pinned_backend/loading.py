"""What a model path holds, loaded: a Hugging Face checkpoint folder or a GGUF file, as one `Checkpoint`.

Either way the result is the same five things: the config, the weights by Hugging Face name in the compute
dtype, the tokenizer, the weights digest and the `quantisation` the stack names (the compute dtype for a folder,
after the packed format some of its tensors are stored in, `mxfp4->bf16`; the stored tensor types and the compute
dtype for a GGUF file). Each step is reported through `report` as it
starts, so whoever waits sees what takes the time. The model itself is model.py's; the stack is stack.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pinned_backend.checkpoint import (
    ModelConfig,
    ignored_layers,
    load_config,
    load_weights,
    stored_quantisation,
    weights_sha256,
)
from pinned_backend.gguf_checkpoint import file_sha256, is_gguf, open_gguf
from pinned_backend.gguf_tokenizer import tokenizer_from_gguf
from pinned_backend.stack import DTYPE_NAMES
from pinned_backend.tokenizer import Tokenizer

Report = Callable[[str], None]


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # consumed by the model
    tokenizer: Tokenizer
    weights_sha256: str
    quantisation: str


def default_name(path: Path) -> str:
    """The name a model is served under unless configured: the folder's name, or the file's without `.gguf`."""
    path = path.resolve()
    return path.stem if is_gguf(path) else path.name


def load_checkpoint(path: Path, dtype: torch.dtype, report: Report = lambda _: None) -> Checkpoint:
    """Load what `path` holds; a CheckpointError names the file and what is wrong or unsupported."""
    path = Path(path)
    timed = _Timed(report)
    if not is_gguf(path):
        timed(f"reading {path}")
        config = load_config(path)
        packed = stored_quantisation(path)
        if packed is not None:
            timed(f"decoding the tensors stored {packed} to {DTYPE_NAMES[dtype]}")
        skipped = ignored_layers(config)
        if skipped:
            timed(f"loading and ignoring {len(skipped)} multi-token prediction layer(s) after the last")
        weights = load_weights(path, config, dtype)
        # A packed format is named with the dtype it is decoded to, as a GGUF's types are.
        quantisation = DTYPE_NAMES[dtype] if packed is None else f"{packed}->{DTYPE_NAMES[dtype]}"
        return Checkpoint(
            config, weights, Tokenizer.from_pretrained(path), weights_sha256(path), quantisation
        )
    size_mb = path.stat().st_size / 1e6 if path.is_file() else 0.0
    timed(f"reading {path} ({size_mb:.0f} MB)")
    gguf = open_gguf(path)
    c = gguf.config
    timed(
        f"a {gguf.architecture} of {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocabulary "
        f"{c.vocab_size}, tensors {'+'.join(gguf.stored_types)}: dequantising to {DTYPE_NAMES[dtype]}"
    )
    weights = gguf.weights(dtype)
    timed("building the tokenizer from the file's vocabulary and merges")
    tokenizer = tokenizer_from_gguf(gguf.fields, str(path))
    timed("hashing the file")
    digest = file_sha256(path)
    timed.done()
    return Checkpoint(c, weights, tokenizer, digest, gguf.quantisation(DTYPE_NAMES[dtype]))


class _Timed:
    """Reports each step with the seconds since loading began."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._start = time.monotonic()

    def __call__(self, step: str) -> None:
        self._report(f"[{time.monotonic() - self._start:5.1f} s] {step}")

    def done(self) -> None:
        self("checkpoint loaded")

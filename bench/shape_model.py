"""A Hugging Face model folder with a real model's shapes, random seeded weights and SmolLM2's tokenizer, for a
benchmark that must serve a model the way `stackpin-backend serve` does (a folder, through `load_runtime`) where no
checkpoint can be downloaded, and needs a tokenizer that llguidance reads (the grammar path).

The shapes are those of a config in `bench/models/` (today Qwen3-1.7B's), except the vocabulary: the embedding and
the tied LM head are as wide as SmolLM2's tokenizer (49,152 tokens) rather than the real model's (151,936 for
Qwen3), so the LM head is about a third of its real width. The weights are `bench.gpu_price.random_weights`, bf16,
seeded (one seed draws other numbers on another device): figures made with them are about speed, never about
answer quality. A folder already written for the same config is reused.

This module knows nothing of serving; it only writes the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import tokenizers
from safetensors.torch import save_file

from pinned_backend.checkpoint import parse_config

MODELS = Path(__file__).resolve().parent / "models"
SHAPES = {"qwen3-1.7b-shape": MODELS / "qwen3-1.7b"}
TOKENIZER = MODELS / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def shaped_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """`name`'s config.json with SmolLM2's vocabulary, and `layers` decoder layers if given (a smaller copy that
    runs the same code path)."""
    config = json.loads((SHAPES[name] / "config.json").read_text())
    vocab = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).get_vocab_size()
    config["vocab_size"] = vocab
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def write_shaped_model(
    name: str, folder: Path, layers: int | None = None, seed: int = 0, device: str = "cpu"
) -> Path:
    """Write (or reuse) `folder` as `name`'s shape with SmolLM2's tokenizer; returns the folder."""
    from bench.gpu_price import random_weights  # imports the Triton kernels' modules: only when writing

    config = shaped_config(name, layers)
    made = {"shape": name, "seed": seed, "device": device}
    weights_file, config_file, made_file = (
        folder / "model.safetensors",
        folder / "config.json",
        folder / "model_shape.json",
    )
    if weights_file.exists() and _json(config_file) == config and _json(made_file) == made:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for file in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / file, folder / file)
    # The backend reads the chat template from tokenizer_config.json, not from chat_template.jinja beside it.
    tokenizer_config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (TOKENIZER / "chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    config_file.unlink(missing_ok=True)  # written last: a folder cut short is written again
    made_file.write_text(json.dumps(made))
    weights = random_weights(parse_config(config, where=str(config_file)), seed, device=device)
    save_file({k: v.cpu().contiguous() for k, v in weights.items()}, str(weights_file))
    config_file.write_text(json.dumps(config, indent=2))
    return folder


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None

"""Small random checkpoints in the Hugging Face folder format, and engines over them, for the backend's tests.

The weights are seeded noise: the model's answers mean nothing, but they are a real Qwen3-shaped decoder (dense, or
Qwen3-MoE-shaped with `MOE_CONFIG`) loaded by the real loader and run by the real kernels, small enough that many
scheduled runs take seconds. The same seed writes the same bytes.
"""

from __future__ import annotations

import json
import string
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tokenizers
import torch
from safetensors.torch import save_file

from pinned_backend.checkpoint import expected_shapes, parse_config
from pinned_backend.engine import Engine, EngineConfig, EngineError, StepStats, TokenOutput
from pinned_backend.kernels import KernelMode, select_kernels
from pinned_backend.kvcache import BlockAllocator, PagedKVCache
from pinned_backend.model import Transformer
from pinned_backend.routing import DROPLESS, ExpertRouting

SMALL_CONFIG = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
# Two layers, the first sparse, the second dense; four experts of which each token takes two.
MOE_CONFIG = {
    **SMALL_CONFIG,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}


CHARACTERS = string.ascii_letters + string.digits + " ,.!?'\n"
SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_random_checkpoint(
    folder: Path,
    seed: int = 0,
    *,
    with_tokenizer: bool | Literal["bytes"] = False,
    config: Mapping[str, object] = SMALL_CONFIG,
) -> Path:
    """A random checkpoint of `config`'s shape; `with_tokenizer` adds a character-level tokenizer and chat
    template, or with "bytes" a byte-level one (every byte a token, as GPT-2's alphabet spells them) that can
    write any text."""
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if with_tokenizer == "bytes":
        config["vocab_size"] = _write_byte_tokenizer(folder)
    elif with_tokenizer:
        config["vocab_size"] = _write_character_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(parse_config(config)).items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensors[name] = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    # Larger logits give sampling something to choose between, rather than a near-uniform distribution.
    tensors["lm_head.weight"] *= 4
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _write_character_tokenizer(folder: Path) -> int:
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def _write_byte_tokenizer(folder: Path) -> int:
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def letters(ids: Sequence[int]) -> str:
    """A stand-in detokenizer: one letter or space per token, so stop strings have text to match."""
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    return "".join(alphabet[i % len(alphabet)] for i in ids)


def make_engine(
    folder: Path,
    mode: KernelMode = "batch_invariant",
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    kv_split_size: int = 8,
    max_batch_size: int = 4,
    max_step_tokens: int = 8,
    max_queue: int = 8,
    eos_token_ids: frozenset[int] = frozenset(),
    on_step: Callable[[StepStats], None] | None = None,
    step_graphs: int = 0,
    prefix_cache: bool = False,
    speculative_tokens: int = 0,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    dependent_launch: bool = True,
    routing: ExpertRouting = DROPLESS,
) -> Engine:
    device = device or torch.device("cpu")
    kernels = select_kernels(mode, device, kv_split_size=kv_split_size, dependent_launch=dependent_launch)
    model = Transformer.from_pretrained(folder, kernels, device, dtype, routing=routing)
    cache = PagedKVCache(model.config, num_blocks, block_size, device, dtype)
    config = EngineConfig(
        max_model_len=model.config.max_position_embeddings,
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch_size=max_batch_size,
        max_step_tokens=max_step_tokens,
        max_queue=max_queue,
        eos_token_ids=eos_token_ids,
        step_graphs=step_graphs,
        prefix_cache=prefix_cache,
        speculative_tokens=speculative_tokens,
    )
    return Engine(model, cache, BlockAllocator(num_blocks), kernels, config, letters, device, on_step)


@dataclass
class Collector:
    outputs: list[TokenOutput] = field(default_factory=list)
    errors: list[EngineError] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event: TokenOutput | EngineError) -> None:
        if isinstance(event, EngineError):
            self.errors.append(event)
            self.done.set()
            return
        self.outputs.append(event)
        if event.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [o.token_id for o in self.outputs]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

"""`stackpin-tiny`: a small Qwen3-format model trained in seconds on a text the project ships.

`make_tiny(directory)` writes a complete Hugging Face checkpoint folder (config.json, model.safetensors, a byte-level
BPE tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json) that the loader reads like
any real one. The tokenizer and the weights are trained on `data/tiny_corpus.txt`, seeded, with a fixed thread
count, so that the files are byte-identical on every run on one machine; greedy output reads as English words, not
noise. Another CPU (another vector ISA or BLAS) may round differently in training and write other weights, which
is why the stack names its weights by digest. The training model below is a plain dense PyTorch module; serving
goes through model.py like any other checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from pinned_backend.checkpoint import ModelConfig, parse_config
from pinned_backend.model import apply_rope, rope_inv_freq

TINY_NAME = "stackpin-tiny"
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_VOCAB_SIZE = 2048
_ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}
_SEED = 20260101
_TRAIN_THREADS = 1
_STEPS = 270
_BATCH = 6
_WINDOW = 128
_PEAK_LR = 5e-3


def corpus_text() -> str:
    return resources.files("pinned_backend").joinpath("data", "tiny_corpus.txt").read_text(encoding="utf-8")


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def train_tokenizer(paragraphs: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer)
    return tokenizer


def _training_stream(paragraphs: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    # Each paragraph twice: as plain text, and as a chat turn whose user opens it and whose assistant goes on,
    # so that the model also learns to answer in ChatML and to end its turn.
    pieces = []
    for paragraph in paragraphs:
        pieces.append(paragraph + END_OF_TEXT)
        first, _, rest = paragraph.partition(". ")
        if rest:
            pieces.append(
                f"{IM_START}user\n{first}.{IM_END}\n{IM_START}assistant\n{rest}{IM_END}\n{END_OF_TEXT}"
            )
    ids: list[int] = []
    for piece in pieces:
        ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
    return torch.tensor(ids, dtype=torch.long)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.q_size, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_size, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_size, bias=False)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=False)
        self.q_norm = _RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = _RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, L, hidden]; cos, sin [L, 1, head_dim / 2]
        b, n, _ = x.shape
        c = self.c
        q = self.q_norm(self.q_proj(x).view(b, n, c.num_attention_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c.q_size))


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([_Block(c) for _ in range(c.num_hidden_layers)])
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


class DenseQwen3(nn.Module):
    """Qwen3 with tied embeddings as one dense module, parameters under Hugging Face names; for training."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Decoder(config)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, L] -> logits [B, L, vocab]
        angles = (torch.arange(ids.shape[1]).float()[:, None] * self.inv_freq[None, :])[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T


def _init_weights(model: nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _train(model: DenseQwen3, stream: torch.Tensor, generator: torch.Generator) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=_PEAK_LR, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = _STEPS // 20
    for step in range(_STEPS):
        lr = _PEAK_LR * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / _STEPS))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, stream.numel() - _WINDOW - 1, (_BATCH,), generator=generator)
        batch = torch.stack([stream[s : s + _WINDOW + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def tiny_config(vocab_size: int) -> dict[str, object]:
    """The config.json object of stackpin-tiny for a tokenizer of `vocab_size` tokens."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        **_ARCHITECTURE,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }


def make_tiny(directory: Path) -> Path:
    """Train stackpin-tiny and write it to `directory`/stackpin-tiny (replacing it); returns that folder."""
    target = Path(directory) / TINY_NAME
    Path(directory).mkdir(parents=True, exist_ok=True)
    # A private staging folder per call: two processes making the model at once never write into one folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_NAME}.", dir=directory))

    paragraphs = _paragraphs(corpus_text())
    tokenizer = train_tokenizer(paragraphs)
    raw_config = tiny_config(tokenizer.get_vocab_size())
    config = parse_config(raw_config)

    # Training reads the process-wide thread count; it is fixed for the run and restored after.
    threads = torch.get_num_threads()
    torch.set_num_threads(_TRAIN_THREADS)
    try:
        generator = torch.Generator().manual_seed(_SEED)
        model = DenseQwen3(config)
        _init_weights(model, generator)
        _train(model, _training_stream(paragraphs, tokenizer), generator)
    finally:
        torch.set_num_threads(threads)

    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(staging / "tokenizer.json"))
    _write_json(staging / "config.json", raw_config)
    _write_json(
        staging / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": _ARCHITECTURE["max_position_embeddings"],
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": END_OF_TEXT,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    eos_ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)]
    _write_json(staging / "generation_config.json", {"eos_token_id": eos_ids, "do_sample": False})
    _publish(staging, target)
    return target


def _publish(staging: Path, target: Path) -> None:
    # mkdtemp and safetensors create owner-only files; the model is meant to be read by any local user.
    staging.chmod(0o755)
    for path in staging.iterdir():
        path.chmod(0o644)
    shutil.rmtree(target, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        # Another process published the same files first; theirs are byte-identical to ours.
        shutil.rmtree(staging, ignore_errors=True)
        if not all((target / name).is_file() for name in TINY_FILES):
            raise


TINY_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def ensure_tiny(directory: Path) -> Path:
    """`directory`/stackpin-tiny, made by `make_tiny` unless a finished one is already there."""
    target = Path(directory) / TINY_NAME
    if all((target / name).is_file() for name in TINY_FILES):
        return target
    return make_tiny(directory)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")

"""How a model's weights are cut among the ranks of a tensor-parallel group, and which fixed chunks each
rank's share of a row-parallel reduction covers.

The two reductions that cross ranks are the attention's output projection (over q_size) and the MLP's down
projection (over the intermediate size). Each is cut into chunks fixed by the model alone, never by the degree:
the output projection by key-value group (one chunk per KV head, its query heads' columns), the down projection
into `MLP_CHUNKS` equal slices. A rank holds a contiguous run of whole chunks, as even as the counts allow (a rank
may hold none when the degree exceeds the chunks), so that every chunk's partial product is the same whatever the
degree, and the fixed-order sum over chunks (combine.py) is one tree at every degree, one process included.
Column-parallel weights (q/k/v, gate/up, the vocabulary's embedding rows and LM head) follow the same cuts; a
column's dot product is computed whole by one rank, which gives it the bits a single process gives it. A mixture of
experts' routed experts are cut into contiguous runs (expert parallelism, moe.py), its router kept whole.

This module knows nothing of processes or communication; it slices tensors by Hugging Face name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pinned_backend.model_config import ModelConfig

# The down projection's reduction is summed in this many slices of the intermediate dimension: up to this degree
# every rank has MLP work; past it some ranks idle in the MLP. Part of the stack (stack.py's `reduction_tree`).
MLP_CHUNKS = 8


class ShardingError(ValueError):
    """The model cannot be cut as asked; says what to change."""


def even_range(count: int, parts: int, index: int) -> range:
    """The `index`-th of `parts` contiguous runs of `count` items, as even as the counts allow."""
    return range(count * index // parts, count * (index + 1) // parts)


def chunk_edges(size: int, chunks: int) -> list[int]:
    """Where `chunks` fixed slices of a dimension of `size` begin and end (`chunks + 1` edges)."""
    return [size * j // chunks for j in range(chunks + 1)]


@dataclass(frozen=True)
class Shard:
    """One rank's share of a model: the global KV heads, MLP chunks and vocabulary rows it holds."""

    rank: int
    degree: int
    kv_heads_total: int
    group_size: int  # query heads per KV head
    head_dim: int
    mlp_edges: tuple[int, ...]  # the MLP_CHUNKS + 1 edges of the intermediate dimension's slices, global
    vocab_edges: tuple[int, ...]  # where each rank's vocabulary begins and the last ends: degree + 1 edges
    experts_total: int = 0  # a mixture of experts' routed experts; 0 for a dense model

    @property
    def kv_heads(self) -> range:
        """The KV groups this rank holds; the o projection's chunks are these groups."""
        return even_range(self.kv_heads_total, self.degree, self.rank)

    @property
    def q_heads(self) -> range:
        kv = self.kv_heads
        return range(kv.start * self.group_size, kv.stop * self.group_size)

    @property
    def mlp_chunks(self) -> range:
        return even_range(len(self.mlp_edges) - 1, self.degree, self.rank)

    @property
    def intermediate(self) -> range:
        chunks = self.mlp_chunks
        return range(self.mlp_edges[chunks.start], self.mlp_edges[chunks.stop])

    @property
    def experts(self) -> range:
        """The routed experts this rank holds (expert parallelism): a contiguous run, as even as the counts allow."""
        return even_range(self.experts_total, self.degree, self.rank)

    def expert_owner(self, expert: int) -> int:
        """The rank that holds `expert`."""
        return next(r for r in range(self.degree) if expert in even_range(self.experts_total, self.degree, r))

    @property
    def vocab(self) -> range:
        return range(self.vocab_edges[self.rank], self.vocab_edges[self.rank + 1])

    def o_widths(self) -> list[int]:
        """The local widths, in order, of the o projection's chunks this rank holds."""
        return [self.group_size * self.head_dim] * len(self.kv_heads)

    def down_widths(self) -> list[int]:
        """The local widths, in order, of the down projection's chunks this rank holds."""
        e = self.mlp_edges
        return [e[j + 1] - e[j] for j in self.mlp_chunks]

    def chunk_counts(self) -> tuple[list[int], list[int]]:
        """How many o and down chunks each rank holds, rank by rank."""
        mlp_chunks = len(self.mlp_edges) - 1
        return (
            [len(even_range(self.kv_heads_total, self.degree, r)) for r in range(self.degree)],
            [len(even_range(mlp_chunks, self.degree, r)) for r in range(self.degree)],
        )


def plan_shard(config: ModelConfig, degree: int, rank: int) -> Shard:
    """Rank `rank`'s share of `config` at `degree`; ShardingError if the model cannot be cut."""
    check_shardable(config, degree)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is not one of the {degree} ranks")
    return Shard(
        rank=rank,
        degree=degree,
        kv_heads_total=config.num_key_value_heads,
        group_size=config.num_attention_heads // config.num_key_value_heads,
        head_dim=config.head_dim,
        mlp_edges=tuple(chunk_edges(config.intermediate_size, MLP_CHUNKS)),
        vocab_edges=tuple(chunk_edges(config.vocab_size, degree)),
        experts_total=config.moe.num_experts if config.moe is not None else 0,
    )


def reduction_tree(config: ModelConfig) -> dict[str, object]:
    """What the stack says of the fixed reduction tree: the chunks each row-parallel product is summed over."""
    return {
        "o_proj_chunks": config.num_key_value_heads,
        "down_proj_chunks": MLP_CHUNKS,
        "order": "sequential_fp32",
    }


def check_shardable(config: ModelConfig, degree: int) -> None:
    """Raise ShardingError naming what keeps `config` from being served at `degree`."""
    if degree < 1:
        raise ShardingError(f"--tensor-parallel must be at least 1, got {degree}")
    if config.mla is not None:
        raise ShardingError(
            f"tensor parallelism does not shard latent attention ({config.model_type}) yet: serve it with "
            "--tensor-parallel left out"
        )
    if config.qk_norm and config.qk_norm_span == "projection":
        raise ShardingError(
            f"{config.model_type} normalises q and k over the whole projection, across every head, so its heads "
            "cannot be cut among ranks: serve it with --tensor-parallel left out"
        )
    if config.intermediate_size < MLP_CHUNKS:
        raise ShardingError(
            f"the MLP's intermediate size {config.intermediate_size} is smaller than the {MLP_CHUNKS} chunks its "
            "reduction is cut into"
        )


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config a rank's Transformer is built from: its heads, its slice of the MLP and of the vocabulary."""
    return dataclasses.replace(
        config,
        num_attention_heads=len(shard.q_heads),
        num_key_value_heads=len(shard.kv_heads),
        intermediate_size=len(shard.intermediate),
        vocab_size=len(shard.vocab),
    )


def shard_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], shard: Shard
) -> dict[str, torch.Tensor]:
    """The tensors a rank keeps, under the names the Transformer takes, cut from the whole model's `weights`
    (consumed); each a contiguous copy, so that the whole tensors can be freed."""
    c = config
    q, kv, mlp, vocab = shard.q_heads, shard.kv_heads, shard.intermediate, shard.vocab
    d = c.head_dim
    q_rows, kv_rows = slice(q.start * d, q.stop * d), slice(kv.start * d, kv.stop * d)
    out: dict[str, torch.Tensor] = {}

    def keep(name: str, tensor: torch.Tensor) -> None:
        out[name] = tensor.contiguous().clone()

    embed = weights.pop("model.embed_tokens.weight")
    keep("model.embed_tokens.weight", embed[vocab.start : vocab.stop])
    if not c.tie_word_embeddings:
        keep("lm_head.weight", weights.pop("lm_head.weight")[vocab.start : vocab.stop])
    for i in range(c.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        # A sparse layer's experts are cut by the Transformer once it has stacked them (moe.shard_experts).
        dense = c.moe is None or i not in c.moe.sparse_layers
        if c.fused_projections:
            fused = weights.pop(a + "qkv_proj.weight")
            wq, wk, wv = fused.split([c.q_size, c.kv_size, c.kv_size])
            keep(a + "qkv_proj.weight", torch.cat([wq[q_rows], wk[kv_rows], wv[kv_rows]]))
            gate, up = weights.pop(m + "gate_up_proj.weight").split(c.intermediate_size)
            keep(m + "gate_up_proj.weight", torch.cat([gate[mlp.start : mlp.stop], up[mlp.start : mlp.stop]]))
        else:
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                keep(a + f"{name}_proj.weight", weights.pop(a + f"{name}_proj.weight")[rows])
                if c.attention_bias:
                    keep(a + f"{name}_proj.bias", weights.pop(a + f"{name}_proj.bias")[rows])
            for name in ("gate", "up") if dense else ():
                keep(m + f"{name}_proj.weight", weights.pop(m + f"{name}_proj.weight")[mlp.start : mlp.stop])
        keep(a + "o_proj.weight", weights.pop(a + "o_proj.weight")[:, q_rows])
        if dense:
            keep(m + "down_proj.weight", weights.pop(m + "down_proj.weight")[:, mlp.start : mlp.stop])
        if c.sinks:
            keep(a + "sinks", weights.pop(a + "sinks")[q.start : q.stop])
    out.update(weights)  # norms and biases every rank applies whole
    weights.clear()
    return out

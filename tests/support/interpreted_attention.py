"""Checks of the GPU's attention variants and the families' other kernels run under Triton's interpreter, on the CPU:
`python -m tests.support.interpreted_attention` with TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py starts it
so). Exits non-zero, naming the case, where:
- the paged attention with a sliding window, soft-capped scores, sinks or all three is not the float64 reference's
  function, or gives a query other bits on its other path (serial, chunks), or amid other queries than alone, or
  with lower queries of its own sequence in its tile (which start its program at an earlier chunk);
- the latent attention is not the reference's, or a query's bits change with the step around it;
- GeGLU's elementwise half is not torch's, or a row's bits follow the rows around it;
- a head's matmul, or an expert with biases and gpt-oss's activation, gives a row other bits in another step.

As for the matmul's checks (tests/support/interpreted_kernels.py): the interpreter computes a dot through numpy, so this
proves which keys, chunks and rows a program takes and that the masks, merges and sinks are right; the GPU's own sums
are for tests/test_kernels_families.py to prove on a GPU. Operands are fp16 (the interpreter gets bf16 wrong).
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from pinned_backend.kernels.triton import TritonKernels
from pinned_backend.kernels.triton.attention import Variant, paged_attention
from pinned_backend.kernels.triton.latent_attention import latent_attention
from pinned_backend.kernels.unfused import clamped_swiglu, gelu_tanh
from tests.support import kernel_reference

PAGE, SPLIT = 16, 64
VARIANTS = {
    "plain": Variant(),
    "a window": Variant(window=40),
    "soft-capped": Variant(softcap=1.5),
    "sinks": Variant(sinks=torch.linspace(-1.0, 2.0, 4)),
    "all three": Variant(window=70, softcap=1.5, sinks=torch.linspace(-1.0, 2.0, 4)),
}


def paged(lengths: list[int], heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A cache of random rows for sequences of `lengths`, each sequence's pages scattered; and its tables."""
    generator = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lengths]
    total = sum(pages) + 2
    k_cache = torch.randn(total, PAGE, heads, dim, generator=generator).to(torch.float16)
    v_cache = torch.randn(total, PAGE, heads, dim, generator=generator).to(torch.float16)
    order = torch.randperm(total, generator=generator)
    tables = torch.zeros(len(lengths), max(pages) + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages):
        tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, tables


def check_attention(failures: list[str]) -> None:
    lengths = [150, 9, 70]
    k_cache, v_cache, tables = paged(lengths, 2, 16, seed=1)
    generator = torch.Generator().manual_seed(2)
    seq = torch.tensor([0, 0, 0, 0, 1, 2, 2], dtype=torch.int32)
    pos = torch.tensor([3, 64, 100, 149, 8, 0, 69], dtype=torch.int32)
    q = torch.randn(7, 4, 16, generator=generator).to(torch.float16) * 2
    for name, variant in VARIANTS.items():
        attend = partial(paged_attention, k_cache=k_cache, v_cache=v_cache, block_tables=tables, scale=0.25)
        run = partial(attend, split=SPLIT, variant=variant)
        serial = run(q, query_seq=seq, query_pos=pos, path="serial")
        expected = kernel_reference.attention(
            q, k_cache, v_cache, tables, seq, pos, 0.25, **_reference_keys(variant)
        )
        if (serial.double() - expected).abs().max() > 2e-2:
            failures.append(f"attention, {name}: not the reference's function")
        for row in (1, 3, 4):  # a query in a window's middle chunk, one past two chunks, another sequence's
            one = (q[row : row + 1], seq[row : row + 1], pos[row : row + 1])
            for path in ("serial", "chunks"):
                alone = run(one[0], query_seq=one[1], query_pos=one[2], path=path)
                if not torch.equal(alone[0], serial[row]):
                    failures.append(f"attention, {name}: query {row} alone on the {path} path changed bits")
        late = run(q[[0, 3]], query_seq=seq[[0, 3]], query_pos=pos[[0, 3]], path="serial")
        if not torch.equal(late[1], serial[3]):
            failures.append(
                f"attention, {name}: a tile starting chunks before a query's window changed its bits"
            )


def _reference_keys(variant: Variant) -> dict[str, object]:
    return {"window": variant.window, "softcap": variant.softcap, "sinks": variant.sinks}


def check_latent_attention(failures: list[str]) -> None:
    latent, rope, heads = 32, 16, 20  # heads past one program's 16, so the masks are exercised
    cache, _, tables = paged([130, 20], 1, latent + rope, seed=3)
    generator = torch.Generator().manual_seed(4)
    seq = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    pos = torch.tensor([0, 65, 19, 129], dtype=torch.int32)
    q = torch.randn(4, heads, latent + rope, generator=generator).to(torch.float16)
    out = latent_attention(q, cache, tables, seq, pos, 0.2, SPLIT, latent)
    expected = kernel_reference.attention(q, cache, cache, tables, seq, pos, 0.2)[..., :latent]
    if (out.double() - expected).abs().max() > 2e-2:
        failures.append("latent attention: not the reference's function")
    for row in range(4):
        alone = latent_attention(
            q[row : row + 1], cache, tables, seq[row : row + 1], pos[row : row + 1], 0.2, SPLIT, 32
        )
        if not torch.equal(alone[0], out[row]):
            failures.append(f"latent attention: query {row} alone changed bits")


def check_dense_families(failures: list[str]) -> None:
    kernels = TritonKernels(kv_split_size=SPLIT)
    generator = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(9, 2 * 40, generator=generator) * 3).to(torch.float16)
    out = kernels.gelu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if not torch.allclose(out.float(), (gelu_tanh(gate) * up).float(), rtol=1e-2, atol=1e-2):
        failures.append("gelu_mul: not gelu_tanh(gate) * up")
    if not torch.equal(kernels.gelu_mul(gate_up[4:5]), out[4:5]):
        failures.append("gelu_mul: a row alone changed bits")
    x = (torch.randint(-8, 9, (7, 3, 32), generator=generator) / 8).to(torch.float16)
    w = (torch.randint(-8, 9, (3, 24, 32), generator=generator) / 8).to(torch.float16)
    heads = kernels.head_matmul(x, w)
    if not torch.equal(heads, torch.einsum("thk,hnk->thn", x.float(), w.float()).to(torch.float16)):
        failures.append("head_matmul: not each head's product")
    if not torch.equal(kernels.head_matmul(x[2:3], w), heads[2:3]):
        failures.append("head_matmul: a row alone changed bits")


def check_biased_experts(failures: list[str]) -> None:
    kernels = TritonKernels(kv_split_size=SPLIT)
    generator = torch.Generator().manual_seed(6)

    def exact(*shape: int) -> torch.Tensor:
        return (torch.randint(-8, 9, shape, generator=generator) / 8).to(torch.float16)

    h, gate_up, down = exact(10, 32), exact(4, 2 * 16, 32), exact(4, 32, 16)
    gate_up_bias, down_bias = exact(4, 2 * 16), exact(4, 32)
    experts = torch.randint(0, 4, (10, 2), generator=generator)
    experts[:, 1] = (experts[:, 0] + 1) % 4
    weights = torch.rand(10, 2, generator=generator)
    activation = partial(clamped_swiglu, alpha=1.702, limit=7.0)
    run = partial(kernels.expert_mlp, gate_up_bias=gate_up_bias, down_bias=down_bias, activation=activation)
    whole = run(h, gate_up, down, experts, weights)
    for rows in ([0], [9], [2, 3, 4]):
        if not torch.equal(run(h[rows], gate_up, down, experts[rows], weights[rows]), whole[rows]):
            failures.append(f"biased experts: rows {rows} in another step changed bits")
    expected = torch.zeros(10, 32, dtype=torch.float64)
    for t in range(10):
        for r in range(2):
            e = int(experts[t, r])
            gated = activation((h[t].float() @ gate_up[e].float().T + gate_up_bias[e].float())[None])[0]
            expected[t] += float(weights[t, r]) * (gated @ down[e].float().T + down_bias[e].float()).double()
    if (whole.double() - expected).abs().max() > 5e-2:
        failures.append("biased experts: not each token's experts with their biases, weighted")


def main() -> int:
    failures: list[str] = []
    for check in (check_attention, check_latent_attention, check_dense_families, check_biased_experts):
        check(failures)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

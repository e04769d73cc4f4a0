"""Checks of the grouped expert matmul run under Triton's interpreter, on the CPU:
`python -m tests.support.interpreted_expert_matmul` with TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py starts it
so). Exits non-zero, naming the case, where a row's result changes with how many rows its expert or the other experts
got, or where an expert's rows differ from that expert's own matmul.

As for the dense matmul's checks (tests/support/interpreted_kernels.py): the interpreter computes a dot through numpy, so
this proves which rows, weights and K steps a program takes, in fp16 on operands of small multiples of 1/8 (every
sum exact in fp32, in any order); the GPU's own sums are for a GPU to prove.
"""

from __future__ import annotations

import sys

import torch

from pinned_backend.kernels.triton.expert_matmul import BLOCK_M, expert_matmul


def exact(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randint(-8, 9, shape, generator=generator) / 8).to(torch.float16)


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    experts, n, k = 4, 80, 72  # N and K not multiples of the tile, so the masks are exercised
    w = exact(generator, experts, n, k)
    rows = exact(generator, 4 * BLOCK_M, k)
    failures = []
    # Loads per expert: an idle expert, a run across block boundaries, runs of one row.
    for loads in ([1, 0, 0, 0], [0, 1, 0, 0], [5, 0, BLOCK_M + 3, 1], [2 * BLOCK_M, 1, 7, BLOCK_M + 5]):
        offsets = torch.tensor([0, *torch.tensor(loads).cumsum(0).tolist()])
        x = rows[: offsets[-1]]
        out = expert_matmul(x, w, offsets)
        for e in range(experts):
            run = slice(int(offsets[e]), int(offsets[e + 1]))
            expected = (x[run].float() @ w[e].float().T).to(torch.float16)
            if not torch.equal(out[run], expected):
                failures.append(f"loads {loads}: expert {e}'s rows differ from its own matmul")
            # A run's first and last rows alone, each its expert's only row, with every other expert idle.
            for i in sorted({run.start, run.stop - 1} if run.stop > run.start else set()):
                alone = torch.zeros(experts + 1, dtype=torch.long)
                alone[e + 1 :] = 1
                if not torch.equal(expert_matmul(x[i : i + 1], w, alone)[0], out[i]):
                    failures.append(f"loads {loads}: row {i} of expert {e} differs from the row alone")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

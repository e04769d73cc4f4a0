"""Checks of the grouped expert matmul run under Triton's interpreter, on the CPU:
`python -m tests.support.interpreted_expert_matmul` with TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py starts it
so). Exits non-zero, naming the case, where a row's result changes with how many rows its expert or the other experts
got, where an expert's rows differ from that expert's own matmul, where a step's dispatch (tokens gathered, k experts
each, some refused) sends a row to the wrong expert, where the sum by rank differs from moe.py's elementwise one, or
where the one-launch dropless routing (expert_routing.py) chooses other experts than routing.py's `route`.

As for the dense matmul's checks (tests/support/interpreted_kernels.py): the interpreter computes a dot through numpy, so
this proves which rows, weights and K steps a program takes, in fp16 on operands of small multiples of 1/8 (every
sum exact in fp32, in any order); the GPU's own sums are for a GPU to prove.
"""

from __future__ import annotations

import sys

import torch

from pinned_backend.kernels.triton.expert_matmul import (
    BLOCK_M,
    combine_by_rank,
    dispatch,
    expert_matmul,
    grouped_matmul,
)
from pinned_backend.kernels.triton.expert_routing import route_top_k
from pinned_backend.routing import DROPPED, route


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
    failures += check_dispatched_steps(generator, w)
    failures += check_routing(generator)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


def check_routing(generator: torch.Generator) -> list[str]:
    failures = []
    for experts, top_k, norm in ((128, 8, True), (6, 2, False), (5, 5, True)):
        logits = torch.randn(9, experts, generator=generator)
        logits[0, :] = 0.5  # every expert tied: the lowest indices win
        logits[1, 3:] = logits[1, 2]  # a tie below the top
        chosen, weights = route_top_k(logits, top_k, norm)
        expected, expected_weights = route(logits, top_k, norm)
        if not torch.equal(chosen, expected):
            failures.append(
                f"routing, top {top_k} of {experts}: experts {chosen[:2].tolist()}, not {expected[:2].tolist()}"
            )
        elif not torch.allclose(weights, expected_weights, rtol=1e-5, atol=1e-7):
            failures.append(f"routing, top {top_k} of {experts}: weights differ beyond rounding")
    return failures


def by_rank_reference(y: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe.py's CPU sum by rank: y [T, k, H] (a refused slot zeros), in the activations' dtype op by op."""
    scales = weights.to(y.dtype)
    out = y[:, 0] * scales[:, :1]
    for r in range(1, y.shape[1]):
        out = out + y[:, r] * scales[:, r : r + 1]
    return out


def check_dispatched_steps(generator: torch.Generator, w: torch.Tensor) -> list[str]:
    failures = []
    n_experts, top_k = w.shape[0], 3
    h = exact(generator, 100, w.shape[2])  # 300 assignments: more than one chunk of the dispatch
    choices = torch.stack([torch.randperm(n_experts, generator=generator)[:top_k] for _ in range(h.shape[0])])
    refused = torch.rand(choices.shape, generator=generator) < 0.2
    choices = torch.where(refused, DROPPED, choices)
    weights = torch.rand(choices.shape, generator=generator)
    whole_plan = dispatch(choices, n_experts)
    rows = grouped_matmul(h, w, whole_plan, whole_plan.token)
    flat = choices.view(-1)
    rows_of = whole_plan.slot_row.long()
    kept = [s for s in range(flat.shape[0]) if int(flat[s]) != DROPPED]
    # Each expert's run holds its assignments in assignment order (a stable sort), the refused after every run.
    expected_order = sorted(kept, key=lambda s: int(flat[s])) + [
        s for s in range(flat.shape[0]) if s not in kept
    ]
    if sorted(range(flat.shape[0]), key=lambda s: int(rows_of[s])) != expected_order:
        failures.append("dispatched step: the sorted rows are not the assignments sorted stably by expert")
    counts = torch.bincount(flat[flat != DROPPED], minlength=n_experts)
    if whole_plan.offsets.tolist() != [0, *counts.cumsum(0).tolist()]:
        failures.append(
            f"dispatched step: offsets {whole_plan.offsets.tolist()} for counts {counts.tolist()}"
        )
    for slot in kept:
        i, e = int(rows_of[slot]), int(flat[slot])
        expected = (h[slot // top_k].float() @ w[e].float().T).to(torch.float16)
        if int(whole_plan.token[i]) != slot // top_k or not torch.equal(rows[i], expected):
            failures.append(
                f"dispatched step: sorted row {i} (assignment {slot}) is not its expert's product"
            )
    whole = combine_by_rank(rows, whole_plan, choices, weights)
    y = rows[rows_of].clone()
    y[flat == DROPPED] = 0
    if not torch.equal(whole, by_rank_reference(y.view(h.shape[0], top_k, -1), choices, weights)):
        failures.append("dispatched step: the sum by rank differs from moe.py's elementwise one")
    # The same tokens in smaller steps: every expert gets other counts, every token the same bits.
    for part in ([0], [5, 6], list(range(1, h.shape[0], 4))):
        plan = dispatch(choices[part], n_experts)
        out = combine_by_rank(grouped_matmul(h, w, plan, torch.tensor(part)[plan.token]), plan, choices[part],
                              weights[part])  # fmt: skip
        if not torch.equal(out, whole[part]):
            failures.append(f"dispatched step: tokens {part[:3]}... differ from the whole step")
    return failures


if __name__ == "__main__":
    sys.exit(main())

"""Specification of the grouped expert matmul's host side (pinned_backend.kernels.triton.expert_matmul): how a step's
rows are cut into blocks, and what it refuses. Its kernel is checked under Triton's interpreter by
tests/test_kernels_interpreted.py. Skipped where Triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pinned_backend.kernels.triton.expert_matmul import BLOCK_M, expert_blocks, expert_matmul


def test_each_experts_run_is_cut_into_blocks_that_never_cross_into_the_next() -> None:
    experts, starts, ends = expert_blocks([0, BLOCK_M + 1, BLOCK_M + 1, BLOCK_M + 4])
    assert experts == [0, 0, 2]
    assert starts == [0, BLOCK_M, BLOCK_M + 1]
    assert ends == [BLOCK_M + 1, BLOCK_M + 1, BLOCK_M + 4]


def test_offsets_that_do_not_cover_the_rows_are_refused() -> None:
    x, w = torch.zeros(5, 8, dtype=torch.float16), torch.zeros(2, 4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="rise from 0 to the 5 rows"):
        expert_matmul(x, w, torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match=r"offsets must be \[experts \+ 1\]"):
        expert_matmul(x, w, torch.tensor([0, 5]))

"""The token masks of one engine step: which tokens each constrained logits row may draw, computed while the model's
forward pass runs.

A constrained sequence that draws this step has one logits row, or for a speculative verify pass one row per
position: the row after its last token and one after each draft token fed. llguidance writes one bitmask row for
each: the first at the matcher's state, the next after advancing it past the first draft, and so on, then rolls the
matcher back, so a draft the sampler rejects leaves no trace in it (the engine commits only the tokens it emits).
The engine offers only drafts the grammar allows (`Matcher.valid_prefix`), so every row gets its mask; a row left
unwritten would allow nothing, never everything.

A mask depends only on the tokens before its row, all known when the step is planned, so `StepMasks.start` hands the
work to a worker thread before the forward pass and `PendingMasks.apply` waits for it after: llguidance computes
without the GIL, and the model's kernels release it too, so the two overlap. Applying a mask keeps the model's
logits where the grammar allows a token and writes -inf elsewhere, row by row, out of place (a graph's output
buffer is left as it was); the mask is a pure function of the sequence's tokens, so under batch-invariant kernels
a masked row's bits depend on nothing else either.

This module knows nothing of scheduling or sampling; the engine says which rows belong to which matcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from pinned_backend.grammar import Matcher


@dataclass(frozen=True)
class MaskRows:
    """A constrained sequence's logits rows this step: `first` at its matcher's state, then one after each draft."""

    matcher: Matcher
    first: int
    drafts: Sequence[int]


class PendingMasks:
    """Masks being computed for one step's logits rows."""

    def __init__(self, done: Future[None], bitmask: torch.Tensor, rows: list[int]) -> None:
        self._done, self._bitmask, self._rows = done, bitmask, rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits [R, V]` with every disallowed token of a constrained row at -inf; other rows as they were."""
        self._done.result()
        index = torch.tensor(self._rows, dtype=torch.int64)
        # The words travel to the logits' device, 32 times fewer bytes than the booleans they unpack to.
        allowed = unpack(self._bitmask[index].to(logits.device), logits.shape[1])
        index = index.to(logits.device)
        masked = logits[index].masked_fill(~allowed, float("-inf"))
        return logits.index_put((index,), masked)


def unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """`bitmask [R, W]` int32, bit j of word i standing for token 32 i + j, as booleans `[R, width]`; tokens past
    the mask's end are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= width:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], width - bits.shape[1])], dim=1)


def _fill(executor: llguidance.LLExecutor, requests: Sequence[MaskRows], bitmask: torch.Tensor) -> None:
    # llguidance writes row K of the bitmask at K * row_bytes; its draft-token call takes only matchers with drafts.
    # (Its torch helpers would do the same, but importing them imports torch's compiler, seconds at start.)
    rows, row_bytes = bitmask.shape[0], bitmask.shape[1] * bitmask.element_size()
    plain = [(r.matcher.ll, r.first) for r in requests if not r.drafts]
    drafted = [(r.matcher.ll, r.first, list(r.drafts)) for r in requests if r.drafts]
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, rows)
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), row_bytes, rows)


class StepMasks:
    """Computes each step's masks on one worker thread; made by the engine, idle until a constrained request comes."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, requests: Sequence[MaskRows], rows: int) -> PendingMasks | None:
        """Begin the masks of `requests` in a bitmask of the step's `rows` logits rows; None if there is nothing to
        mask."""
        if not requests:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stackpin-masks")
            self._executor = llguidance.LLExecutor()
        vocab_size = max(r.matcher.vocab_size for r in requests)
        bitmask = torch.zeros((rows, -(-vocab_size // 32)), dtype=torch.int32)
        done = self._pool.submit(_fill, self._executor, requests, bitmask)
        covered = [r.first + i for r in requests for i in range(1 + len(r.drafts))]
        return PendingMasks(done, bitmask, covered)

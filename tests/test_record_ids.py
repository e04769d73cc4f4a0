"""Record ids: 128 random bits each, in the one form the API and the audit log use, and never repeated."""

from __future__ import annotations

import re

import pytest

from proxy.record_ids import ID_BYTES, RecordIds

FORM = re.compile(r"rec_[0-9a-f]{32}")


def test_ids_take_the_record_form_and_do_not_repeat_across_many_refills() -> None:
    ids = RecordIds(randomness=4 * ID_BYTES)  # a refill every four ids
    drawn = [ids() for _ in range(10_000)]
    assert all(FORM.fullmatch(i) for i in drawn)
    assert len(set(drawn)) == len(drawn)


def test_two_sources_share_no_id() -> None:
    first, second = RecordIds(), RecordIds()
    assert not {first() for _ in range(1000)} & {second() for _ in range(1000)}


def test_every_bit_of_an_id_varies() -> None:
    """No byte of the 16 is fixed: the pool is sliced at whole ids, never at an offset that repeats a byte."""
    ids = RecordIds(randomness=ID_BYTES)
    digits = [ids()[4:] for _ in range(400)]
    for position in range(32):
        assert len({d[position] for d in digits}) > 8, f"hex digit {position} hardly varies"


@pytest.mark.parametrize("randomness", [0, 8, ID_BYTES + 1])
def test_a_pool_that_is_not_whole_ids_is_refused(randomness: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        RecordIds(randomness=randomness)

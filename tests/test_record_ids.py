"""Record ids: 128 random bits each, in the one form the API and the audit log use, and never repeated."""

from __future__ import annotations

import re

import pytest

from proxy.serving.record_ids import ID_BYTES, RecordIds

FORM = re.compile(r"rec_[0-9a-f]{32}")


def test_ids_take_the_record_form_and_do_not_repeat_across_many_refills() -> None:
    ids = RecordIds(randomness=4 * ID_BYTES)  # a refill every four ids
    drawn = [ids() for _ in range(10_000)]
    assert all(FORM.fullmatch(i) for i in drawn)
    assert len(set(drawn)) == len(drawn)


def test_two_sources_share_no_id() -> None:
    first, second = RecordIds(), RecordIds()
    assert not {first() for _ in range(1000)} & {second() for _ in range(1000)}


def test_every_bit_of_an_id_varies_wherever_in_the_pool_it_was_cut() -> None:
    """No bit of the 128 is fixed, for ids from every slot of the pool: it is cut at whole ids."""
    ids = RecordIds(randomness=8 * ID_BYTES)
    drawn = [int(ids()[4:], 16) for _ in range(8 * 64)]
    for slot in range(8):
        from_slot = drawn[slot::8]
        for bit in range(8 * ID_BYTES):
            seen = {(value >> bit) & 1 for value in from_slot}
            assert seen == {0, 1}, f"bit {bit} of the ids from slot {slot} never changes"


@pytest.mark.parametrize("randomness", [0, 8, ID_BYTES + 1])
def test_a_pool_that_is_not_whole_ids_is_refused(randomness: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        RecordIds(randomness=randomness)

"""Signed notes, checkpoints and cosignatures: the C2SP formats, checked against the specification's own example."""

from __future__ import annotations

import base64

import pytest

from proxy.audit.note import (
    COSIGNATURE,
    Checkpoint,
    NoteError,
    cosign,
    cosigned_at,
    generate_signer,
    open_checkpoint,
    parse_checkpoint,
    parse_note,
    parse_signer,
    parse_vkey,
    sign_note,
    verified_by,
)

# From c2sp.org/signed-note: this verifier key verifies this note.
SPEC_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
SPEC_NOTE = (
    "This is an example message.\n\n"
    "\u2014 example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
)
LOG = generate_signer("stackpin.test/log", seed=bytes(range(32)))
WITNESS = generate_signer("witness.test/w1", COSIGNATURE, seed=bytes(range(1, 33)))


def test_the_specification_example_verifies() -> None:
    verifier = parse_vkey(SPEC_VKEY)
    note = parse_note(SPEC_NOTE)
    assert verifier.vkey == SPEC_VKEY
    assert verified_by(note, [verifier]) == [verifier]
    assert note.render() == SPEC_NOTE
    tampered = parse_note(SPEC_NOTE.replace("example message", "example massage"))
    with pytest.raises(NoteError, match="does not verify"):
        verified_by(tampered, [verifier])


def test_keys_round_trip_through_their_text() -> None:
    assert parse_signer(LOG.text) == LOG
    assert parse_vkey(LOG.verifier.vkey) == LOG.verifier
    assert LOG.text.startswith("PRIVATE+KEY+stackpin.test/log+")
    assert parse_vkey(WITNESS.verifier.vkey).kind == COSIGNATURE
    with pytest.raises(NoteError, match="not its own"):
        parse_signer(LOG.text.replace(f"+{LOG.verifier.key_id:08x}+", "+00000000+"))
    with pytest.raises(NoteError, match="NAME\\+KEYID\\+BASE64"):
        parse_vkey("not a key")
    with pytest.raises(NoteError, match="without spaces"):
        generate_signer("two words")


def test_a_checkpoint_is_the_documented_note() -> None:
    checkpoint = Checkpoint("stackpin.test/log", 20852163, bytes(32))
    note = sign_note(checkpoint.text, LOG)
    rendered = note.render()
    assert rendered.startswith(
        "stackpin.test/log\n20852163\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n\n\u2014 stackpin.test/log "
    )
    payload = base64.b64decode(rendered.rsplit(" ", 1)[1])
    assert int.from_bytes(payload[:4], "big") == LOG.verifier.key_id and len(payload) == 68
    assert open_checkpoint(rendered, [LOG.verifier])[0] == checkpoint


def test_an_unknown_key_or_a_forged_checkpoint_is_refused() -> None:
    rendered = sign_note(Checkpoint("stackpin.test/log", 5, b"\x01" * 32).text, LOG).render()
    other = generate_signer("stackpin.test/log")
    with pytest.raises(NoteError, match=r"carries no signature of stackpin\.test/log"):
        open_checkpoint(rendered, [other.verifier])
    forged = rendered.replace("\n5\n", "\n6\n")
    with pytest.raises(NoteError, match="does not verify"):
        open_checkpoint(forged, [LOG.verifier])
    impostor = generate_signer("elsewhere.test/log")
    with pytest.raises(NoteError, match="not the name of the key"):
        open_checkpoint(
            sign_note(Checkpoint("stackpin.test/log", 5, bytes(32)).text, impostor).render(),
            [impostor.verifier],
        )


def test_a_rotated_key_is_one_more_trusted_verifier() -> None:
    new = generate_signer("stackpin.test/log")
    old_note = sign_note(Checkpoint("stackpin.test/log", 5, bytes(32)).text, LOG).render()
    new_note = sign_note(Checkpoint("stackpin.test/log", 9, bytes(32)).text, new).render()
    trusted = [LOG.verifier, new.verifier]
    assert open_checkpoint(old_note, trusted)[0].size == 5
    assert open_checkpoint(new_note, trusted)[0].size == 9


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("origin\n5\n", "non-empty lines"),
        ("origin\n05\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n", "leading zeros"),
        ("origin\n5\nAAAA\n", "32 bytes"),
        ("origin\n5\n!!!\n", "base64"),
    ],
)
def test_malformed_checkpoints_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(NoteError, match=message):
        parse_checkpoint(text)


def test_a_cosignature_is_timestamped_and_checked() -> None:
    note = sign_note(Checkpoint("stackpin.test/log", 5, bytes(32)).text, LOG)
    cosigned = cosign(note, WITNESS, 1679315147)
    reread = parse_note(cosigned.render())
    assert cosigned_at(reread, WITNESS.verifier) == 1679315147
    assert verified_by(reread, [LOG.verifier]) == [LOG.verifier], "the log's signature stays valid"
    payload = base64.b64decode(cosigned.render().rstrip("\n").rsplit(" ", 1)[1])
    assert payload[4:12] == (1679315147).to_bytes(8, "big")
    with pytest.raises(NoteError, match="no cosignature"):
        cosigned_at(note, WITNESS.verifier)
    with pytest.raises(NoteError, match="cosigner key"):
        cosign(note, LOG, 1)

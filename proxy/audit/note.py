"""Signed notes (C2SP signed-note), checkpoints (C2SP tlog-checkpoint) and Ed25519 cosignatures (C2SP
tlog-cosignature), with Ed25519 from the `cryptography` package.

A key has a name (for the log: its origin, e.g. `stackpin.example/log`) and a type byte: 0x01 for a log's
Ed25519 note signature, 0x04 for a witness's timestamped cosignature. Its key ID is
SHA-256(name || "\\n" || type || public key)[:4]. Keys are written as text:

    vkey (public):   <name>+<hex key id>+<base64(type || 32-byte public key)>
    private key:     PRIVATE+KEY+<name>+<hex key id>+<base64(type || 32-byte seed)>

Pure functions and small values; where keys come from (a file, an environment variable) is the caller's
business, and nothing here touches a database.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

LOG_SIGNATURE = 0x01
COSIGNATURE = 0x04
KINDS = {LOG_SIGNATURE: "log", COSIGNATURE: "cosigner"}
EM_DASH = "\u2014"
MAX_SIGNATURES = 16


class NoteError(ValueError):
    """A key, note or checkpoint that is malformed or does not verify; the message says what is wrong."""


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise NoteError(f"{what} is not valid base64") from exc


def _check_name(name: str) -> None:
    if not name or any(c.isspace() or c == "+" for c in name):
        raise NoteError(f"a key name must be non-empty, without spaces or '+': {name!r}")


def key_id(name: str, kind: int, public: bytes) -> int:
    return int.from_bytes(hashlib.sha256(name.encode() + b"\n" + bytes([kind]) + public).digest()[:4], "big")


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True)
class Verifier:
    """A public key that checks signatures of one name and kind."""

    name: str
    kind: int
    public: bytes

    @property
    def key_id(self) -> int:
        return key_id(self.name, self.kind, self.public)

    @property
    def vkey(self) -> str:
        encoded = base64.b64encode(bytes([self.kind]) + self.public).decode()
        return f"{self.name}+{self.key_id:08x}+{encoded}"

    def check(self, message: bytes, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.public).verify(signature, message)
        except InvalidSignature:
            return False
        return True


def parse_vkey(text: str) -> Verifier:
    parts = text.strip().split("+", 2)
    if len(parts) != 3:
        raise NoteError(f"a verifier key is NAME+KEYID+BASE64, got {text.strip()[:80]!r}")
    name, hex_id, encoded = parts
    _check_name(name)
    raw = _b64decode(encoded, "the verifier key's public key")
    if len(raw) != 33 or raw[0] not in KINDS:
        raise NoteError("a verifier key holds a type byte (0x01 or 0x04) and a 32-byte Ed25519 public key")
    verifier = Verifier(name, raw[0], raw[1:])
    if f"{verifier.key_id:08x}" != hex_id.lower():
        raise NoteError(
            f"the verifier key for {name} names key ID {hex_id}, its key has {verifier.key_id:08x}"
        )
    return verifier


@dataclass(frozen=True)
class Signer:
    name: str
    kind: int
    seed: bytes

    @property
    def verifier(self) -> Verifier:
        return Verifier(self.name, self.kind, _raw_public(self._key.public_key()))

    @property
    def _key(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def text(self) -> str:
        encoded = base64.b64encode(bytes([self.kind]) + self.seed).decode()
        return f"PRIVATE+KEY+{self.name}+{self.verifier.key_id:08x}+{encoded}"

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def generate_signer(name: str, kind: int = LOG_SIGNATURE, seed: bytes | None = None) -> Signer:
    """A new key (`seed` only for tests that need the same key every run)."""
    _check_name(name)
    if kind not in KINDS:
        raise NoteError(f"unknown key type {kind:#04x}")
    key = Ed25519PrivateKey.generate() if seed is None else Ed25519PrivateKey.from_private_bytes(seed)
    return Signer(name, kind, key.private_bytes_raw())


def parse_signer(text: str) -> Signer:
    parts = text.strip().split("+", 4)
    if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"]:
        raise NoteError("a private key is PRIVATE+KEY+NAME+KEYID+BASE64 (as `stackpin keygen` writes it)")
    _, _, name, hex_id, encoded = parts
    _check_name(name)
    raw = _b64decode(encoded, "the private key")
    if len(raw) != 33 or raw[0] not in KINDS:
        raise NoteError("a private key holds a type byte (0x01 or 0x04) and a 32-byte Ed25519 seed")
    signer = Signer(name, raw[0], raw[1:])
    if f"{signer.verifier.key_id:08x}" != hex_id.lower():
        raise NoteError(f"the private key for {name} names key ID {hex_id}, which is not its own")
    return signer


@dataclass(frozen=True)
class NoteSignature:
    name: str
    key_id: int
    signature: bytes

    @property
    def line(self) -> str:
        payload = struct.pack(">I", self.key_id) + self.signature
        return f"{EM_DASH} {self.name} {base64.b64encode(payload).decode()}\n"


@dataclass(frozen=True)
class Note:
    text: str  # ends with a newline
    signatures: tuple[NoteSignature, ...]

    def render(self) -> str:
        return self.text + "\n" + "".join(s.line for s in self.signatures)

    def with_signature(self, signature: NoteSignature) -> Note:
        return Note(self.text, (*self.signatures, signature))


def parse_note(rendered: str) -> Note:
    if any(ord(c) < 0x20 and c != "\n" for c in rendered):
        raise NoteError("a signed note must not contain control characters other than newlines")
    text, sep, block = rendered.rpartition("\n\n")
    if not sep or not text or not block.endswith("\n"):
        raise NoteError("a signed note is text, a blank line, and signature lines each ending in a newline")
    signatures = []
    for line in block[:-1].split("\n"):
        dash, _, rest = line.partition(" ")
        name, _, encoded = rest.partition(" ")
        if dash != EM_DASH or not name or not encoded or " " in encoded:
            raise NoteError(f"not a signature line: {line[:80]!r}")
        payload = _b64decode(encoded, f"the signature of {name}")
        if len(payload) < 5:
            raise NoteError(f"the signature of {name} is too short")
        signatures.append(NoteSignature(name, struct.unpack(">I", payload[:4])[0], payload[4:]))
    if len(signatures) > MAX_SIGNATURES:
        raise NoteError(f"a note with {len(signatures)} signatures (at most {MAX_SIGNATURES} are read)")
    return Note(text + "\n", tuple(signatures))


def sign_note(text: str, signer: Signer) -> Note:
    if signer.kind != LOG_SIGNATURE:
        raise NoteError(f"{signer.name} is a cosigner key; a log signs with a log key (type 0x01)")
    verifier = signer.verifier
    return Note(text, (NoteSignature(signer.name, verifier.key_id, signer.sign(text.encode())),))


def _matching(note: Note, verifier: Verifier) -> list[NoteSignature]:
    return [s for s in note.signatures if (s.name, s.key_id) == (verifier.name, verifier.key_id)]


def verified_by(note: Note, verifiers: list[Verifier]) -> list[Verifier]:
    """The log keys among `verifiers` whose signature on `note` verifies; NoteError when one of them fails."""
    good = []
    for verifier in verifiers:
        if verifier.kind != LOG_SIGNATURE:
            continue
        for signature in _matching(note, verifier):
            if not verifier.check(note.text.encode(), signature.signature):
                raise NoteError(f"the signature of {verifier.name} ({verifier.key_id:08x}) does not verify")
            good.append(verifier)
    return good


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes

    @property
    def text(self) -> str:
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


def parse_checkpoint(text: str) -> Checkpoint:
    lines = text.split("\n")
    if len(lines) < 4 or lines[-1] != "" or any(not line for line in lines[:-1]):
        raise NoteError("a checkpoint's text is an origin, a tree size and a root hash, on non-empty lines")
    origin, size, root = lines[:3]
    if not size.isascii() or not size.isdigit() or (size != "0" and size.startswith("0")):
        raise NoteError(f"a checkpoint's tree size is a decimal number without leading zeros, got {size!r}")
    digest = _b64decode(root, "the checkpoint's root hash")
    if len(digest) != 32:
        raise NoteError("a checkpoint's root hash is 32 bytes")
    return Checkpoint(origin, int(size), digest)


def open_checkpoint(rendered: str, verifiers: list[Verifier]) -> tuple[Checkpoint, Note]:
    """The checkpoint in a signed note that one of `verifiers` signed; NoteError otherwise."""
    note = parse_note(rendered)
    checkpoint = parse_checkpoint(note.text)
    good = verified_by(note, verifiers)
    if not good:
        names = ", ".join(f"{v.name} ({v.key_id:08x})" for v in verifiers if v.kind == LOG_SIGNATURE)
        raise NoteError(
            f"the checkpoint of size {checkpoint.size} carries no signature of {names or 'no key'}"
        )
    if all(v.name != checkpoint.origin for v in good):
        raise NoteError(
            f"the checkpoint's origin {checkpoint.origin!r} is not the name of the key that signed it"
        )
    return checkpoint, note


def _cosigned_message(note_text: str, timestamp: int) -> bytes:
    return f"cosignature/v1\ntime {timestamp}\n{note_text}".encode()


def cosign(note: Note, signer: Signer, timestamp: int) -> Note:
    """Adds a witness's timestamped Ed25519 cosignature (tlog-cosignature, type 0x04) to a checkpoint note."""
    if signer.kind != COSIGNATURE:
        raise NoteError(f"{signer.name} is a log key; a witness cosigns with a cosigner key (type 0x04)")
    if not 0 <= timestamp < 2**63:
        raise NoteError("a cosignature's timestamp is seconds since the epoch")
    signed = signer.sign(_cosigned_message(note.text, timestamp))
    payload = struct.pack(">Q", timestamp) + signed
    return note.with_signature(NoteSignature(signer.name, signer.verifier.key_id, payload))


def cosigned_at(note: Note, verifier: Verifier) -> int:
    """The timestamp of `verifier`'s cosignature on `note`; NoteError when there is none or it fails."""
    if verifier.kind != COSIGNATURE:
        raise NoteError(f"{verifier.name} is not a cosigner key (type 0x04)")
    for signature in _matching(note, verifier):
        if len(signature.signature) != 72:
            raise NoteError(f"the cosignature of {verifier.name} is not 8 + 64 bytes")
        timestamp = struct.unpack(">Q", signature.signature[:8])[0]
        if verifier.check(_cosigned_message(note.text, timestamp), signature.signature[8:]):
            return int(timestamp)
        raise NoteError(f"the cosignature of {verifier.name} ({verifier.key_id:08x}) does not verify")
    raise NoteError(f"the note carries no cosignature of {verifier.name} ({verifier.key_id:08x})")

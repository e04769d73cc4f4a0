"""Replica kinds: the one seam between the proxy and the kinds of server a replica can be.

    ReplicaKind         what the proxy asks of a kind; one module here implements it per kind
      stackpin          a pinned_backend: proves its stack at `GET /v1/stack`; every answer names its fingerprint
      upstream          an OpenAI-compatible API: its stack and routes are declared in configuration
      vllm, sglang,     engines that report their stack: built from what the running server says about itself
      llamacpp, ollama  (engine.py holds what they share)

A kind says where its stack comes from (`StackSource`: proven, reported or declared, which the record keeps), how
to fetch and build it, which routes it answers itself and which through the proxy's translation, how a forwarded
request is adjusted (asking for token ids and logprobs), how an answer's token ids and logprobs are read into the
`stackpin` extension that records and replays know, whether an answer shows it came from the registered stack,
and how its refusals map onto the one error tree (proxy/errors.py). Configuration, the registry, the health
monitor, dispatch, serving and fleet sync ask a replica's kind; none reads a flag. A new kind is one module here,
its entry in `KINDS`, and its tests.
"""

from __future__ import annotations

from types import MappingProxyType

from proxy.replicas.kinds import llamacpp, ollama, sglang, stackpin, upstream, vllm
from proxy.replicas.kinds.base import ReplicaKind, StackSource

KINDS: MappingProxyType[str, ReplicaKind] = MappingProxyType(
    {k.name: k for k in (stackpin.KIND, upstream.KIND, vllm.KIND, sglang.KIND, llamacpp.KIND, ollama.KIND)}
)
STACKPIN = stackpin.KIND
UPSTREAM = upstream.KIND

__all__ = ["KINDS", "STACKPIN", "UPSTREAM", "ReplicaKind", "StackSource", "kind_named"]


def kind_named(name: str) -> ReplicaKind:
    """The kind called `name`; ValueError naming the known ones otherwise."""
    if name not in KINDS:
        raise ValueError(f"unknown replica kind {name!r}; the kinds are {', '.join(KINDS)}")
    return KINDS[name]

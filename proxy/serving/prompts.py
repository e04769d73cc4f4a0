"""Prompt versions: named, versioned system prompts the proxy holds and injects, stored by content hash.

`prompt=support@3` in a pin makes the proxy put that exact text first in the conversation as the system message.
The record keeps the version and the SHA-256 of the text; the audit store keeps the text once per hash.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from proxy.errors import BadRequest
from proxy.pins import parse_prompt_ref


@dataclass(frozen=True)
class PromptVersion:
    name: str
    version: int
    text: str

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class PromptBook:
    versions: dict[str, PromptVersion]

    @classmethod
    def from_config(cls, prompts: dict[str, str]) -> PromptBook:
        versions = {}
        for ref, text in prompts.items():
            name, version = parse_prompt_ref(ref)
            versions[ref] = PromptVersion(name, version, text)
        return cls(versions)

    def resolve(self, ref: str) -> PromptVersion:
        name, _ = parse_prompt_ref(ref)
        found = self.versions.get(ref)
        if found is None:
            known = sorted(v.ref for v in self.versions.values() if v.name == name)
            hint = (
                f"known versions of {name!r}: {', '.join(known)}"
                if known
                else f"no prompt named {name!r} exists"
            )
            raise BadRequest(f"unknown prompt version {ref!r}; {hint}", param="prompt")
        return found


def inject(body: dict[str, Any], endpoint: str, prompt: PromptVersion) -> dict[str, Any]:
    """The body with the prompt's text first: the first system message of a chat, the start of a response's
    instructions (which, unlike input, a later turn does not carry over). The caller's body is left untouched."""
    injected = copy.copy(body)
    if endpoint == "/v1/chat/completions":
        injected["messages"] = [{"role": "system", "content": prompt.text}, *body["messages"]]
    elif endpoint == "/v1/responses":
        own = body.get("instructions")
        injected["instructions"] = prompt.text + (f"\n\n{own}" if isinstance(own, str) and own else "")
    else:
        raise BadRequest(
            f"prompt versions apply to /v1/chat/completions and /v1/responses, not {endpoint}", param="prompt"
        )
    return injected

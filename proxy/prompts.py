"""Prompt versions: named, versioned system prompts the proxy holds and injects, stored by content hash.

`prompt=support@3` in a pin makes the proxy put that exact text first in the conversation as the system message.
The record keeps the version and the SHA-256 of the text; the audit store keeps the text once per hash.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
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

    @property
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
    """The body with the prompt's text as the first system message; the caller's body is left untouched."""
    if endpoint != "/v1/chat/completions":
        raise BadRequest(f"prompt versions apply to /v1/chat/completions, not {endpoint}", param="prompt")
    injected = copy.copy(body)
    injected["messages"] = [{"role": "system", "content": prompt.text}, *body["messages"]]
    return injected

"""gpt-oss's chat format (harmony), as far as a chat answer needs it: an answer's text is its `final` channel.

A harmony answer is a run of messages, each `<|channel|>NAME[ to=RECIPIENT][<|constrain|>TYPE]<|message|>TEXT`,
ended by `<|end|>` (another message follows, after `<|start|>assistant`), `<|return|>` (the answer is done) or
`<|call|>` (a tool call awaits its result). The prompt is rendered by the checkpoint's own chat template
(tokenizer.py), and `<|return|>` and `<|call|>` end generation because the checkpoint's generation_config names them
as its end tokens. What a client receives as the answer is the text of its `final` messages: the `analysis` channel
(the model's reasoning) and `commentary` (preambles and tool calls) are not part of it. Tool calls are read
elsewhere, if at all.

`answer_text` wraps a tokenizer's decode into the engine's `detokenize`: a pure function of the completion's ids,
recomputed as they grow, whose result only ever extends (a final message's text grows; a message of another channel
adds nothing), so stop strings and streaming work on it unchanged. Output with no channel marker (a plain
completion) is decoded as usual. This module knows nothing of models or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

CHANNEL, MESSAGE, CONSTRAIN, START = "<|channel|>", "<|message|>", "<|constrain|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
Decode = Callable[..., str]  # a tokenizer's decode(ids, skip_special_tokens=...)


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str
    recipient: str | None  # `to=...`: a tool call's function (`functions.get_weather`)
    text: str
    ended: bool  # its end marker has been generated


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's checkpoints)."""
    return chat_template is not None and CHANNEL in chat_template and MESSAGE in chat_template


def messages(text: str) -> list[HarmonyMessage]:
    """The messages of an answer decoded with its special tokens; a message whose header is not yet complete is
    not one yet."""
    found = []
    for part in text.split(CHANNEL)[1:]:
        header, complete, body = part.partition(MESSAGE)
        if not complete:
            continue
        header = header.split(CONSTRAIN, 1)[0]
        channel, _, rest = header.strip().partition(" ")
        recipient = rest.strip().removeprefix("to=") if rest.strip().startswith("to=") else None
        cut = min((i for i in (body.find(marker) for marker in (*ENDS, START)) if i >= 0), default=-1)
        found.append(HarmonyMessage(channel, recipient, body if cut < 0 else body[:cut], cut >= 0))
    return found


def final_text(text: str) -> str:
    """The answer a client sees: the text of the final channel's messages."""
    return "".join(m.text for m in messages(text) if m.channel == "final")


def answer_text(decode: Decode) -> Callable[[Sequence[int]], str]:
    """The engine's `detokenize` for a harmony checkpoint."""

    def text(ids: Sequence[int]) -> str:
        raw = decode(list(ids), skip_special_tokens=False)
        return final_text(raw) if CHANNEL in raw else decode(list(ids))

    return text

"""Incremental detokenization with stop strings: the text a response carries, piece by piece.

Each step releases the text past what was already sent, holding back what could still change: a trailing
U+FFFD (a multi-byte character split between tokens) and the last len(stop) - 1 characters, which could be
the start of a stop string. A stop string ends the text before it. The pieces released, joined, are the final
text, so a stream and a whole response agree.

Decoding is incremental, so a step costs the same at token 10 and token 4000 (it runs between the engine's
cycles, on the decode's critical path): only the tokens since the last stable point are decoded, beside the
few before it that give them their context (a leading space depends on what precedes it), as vLLM and TGI do.
Where that window's text does not extend its context's, the whole sequence is decoded again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


class TextStream:
    """feed(tokens) -> newly released text; `stopped` once a stop string appeared; finish() -> the rest."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False
        self._stable = ""  # the text of tokens[:_read], final
        self._prefix = 0  # tokens[_prefix:_read] decode to _context: the context of what follows _read
        self._read = 0
        self._context = ""

    def feed(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._release(text[:cut])
        end = len(text) - self.hold
        while end > 0 and text[end - 1] == _REPLACEMENT:
            end -= 1
        return self._release(text[: max(end, 0)])

    def finish(self) -> str:
        """The text held back, once generation has ended."""
        return "" if self.stopped else self._release(self._decode())

    @property
    def text(self) -> str:
        return self.sent

    def _decode(self) -> str:
        """The text of every token so far: _stable plus what the tokens after _read add to their context."""
        window = self.tokenizer.decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if not window.startswith(self._context):  # the new tokens changed their context's text: start over
            self._stable = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self._prefix = self._read = len(self.tokens)
            self._context = ""
            return self._stable
        tail = window[len(self._context):]
        if tail.endswith(_REPLACEMENT):  # a character still incomplete: nothing is final yet
            return self._stable + tail
        self._stable += tail
        self._prefix, self._read = self._read, len(self.tokens)
        self._context = self.tokenizer.decode(self.tokens[self._prefix:], skip_special_tokens=True)
        return self._stable

    def _stop_at(self, text: str) -> int | None:
        """The start of the earliest stop string in text; only the unsent tail (plus an overlap) can hold a new one."""
        start = max(0, len(self.sent) - self.hold)
        found = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _release(self, upto: str) -> str:
        """Send what `upto` adds to the text sent so far (nothing where decoding changed the sent prefix)."""
        if len(upto) <= len(self.sent) or not upto.startswith(self.sent):
            return ""
        piece = upto[len(self.sent):]
        self.sent = upto
        return piece

"""Incremental detokenisation with stop strings, one token at a time.

Text is decoded over a short window of token ids (the ids since the last complete piece of
text), so a multi-byte character split over several byte-level tokens appears once it is
complete, and a tokenizer that strips a leading space from a decode (SentencePiece) gives
the same text as decoding the whole output at once. Text that could be the beginning of a
stop string is held back until it is known not to be one; a stop string ends the text
before it, whichever chunks it was split over.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed it the request's output token ids as they grow (:meth:`push`); it returns the
    text that may be sent now. ``tokenizer`` None: no text (every delta is empty)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""
        """All text decoded so far (cut before a stop string once one matched)."""
        self.sent = 0
        """Characters of ``text`` already returned."""
        self.stopped: Optional[str] = None
        """The stop string that matched, once one did."""
        self.num_tokens = 0
        """Output tokens that count: all of them, or up to the one completing a stop string."""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: Sequence[int], finished: bool) -> str:
        """New text to send, given the request's whole output so far. After a stop string
        matched, :attr:`stopped` is set and later calls return ''."""
        if self.stopped is not None:
            return ""
        for tok in token_ids[len(self.ids) :]:
            self.ids.append(tok)
            self.num_tokens += 1
            if self.tokenizer is None:
                continue
            before = self._decode(self.ids[self._prefix : self._read])
            after = self._decode(self.ids[self._prefix :])
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                self._add(after[len(before) :])
                self._prefix, self._read = self._read, len(self.ids)
            if self.stopped is not None:
                return self._take(len(self.text))
        if self.tokenizer is not None and finished and self._read < len(self.ids):
            # The output ends inside a character: send what the whole decode gives for it.
            before = self._decode(self.ids[self._prefix : self._read])
            after = self._decode(self.ids[self._prefix :])
            if len(after) > len(before):
                self._add(after[len(before) :])
            self._read = len(self.ids)
        if finished or self.stopped is not None:
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def _add(self, new: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            pos, s = min(hits)
            self.text = self.text[:pos]
            self.stopped = s

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins a stop string."""
        n = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), n, -1):
                if self.text.endswith(s[:k]):
                    n = k
                    break
        return n

    def _take(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

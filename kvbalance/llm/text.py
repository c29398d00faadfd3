"""Text for the real engine: incremental detokenisation and stop strings.

:class:`Detokenizer` turns a request's growing token list into text a little at a time (holding back an
incomplete UTF-8 sequence); :func:`emit_delta` hands out only text that cannot still turn out to start a
stop string; :func:`find_stop` finds where a stop string ends the text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class Detokenizer:
    """Incremental detokenisation with a small window (holds back incomplete UTF-8 sequences).

    Steps can be deferred (:meth:`defer`) and run later, in order, when someone reads the text
    (:meth:`upto`): the same :meth:`step` calls on the same token prefixes, so the same text.
    """

    __slots__ = ("prefix_offset", "read_offset", "text", "sent", "pending", "ends", "covered")

    def __init__(self) -> None:
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0  # characters of ``text`` already emitted as deltas
        self.pending: deque[int] = deque()  # deferred steps: token counts, ascending
        self.ends: dict[int, int] = {0: 0}  # len(text) after the step over the first k tokens
        self.covered = 0  # tokens the deferred steps cover so far

    def defer(self, num_tokens: int) -> int:
        """Note a step over the first ``num_tokens`` tokens, to run when its text is read; returns the
        tokens the previous deferred step covered (where this step's text starts)."""
        before, self.covered = self.covered, num_tokens
        self.pending.append(num_tokens)
        return before

    def upto(self, tokenizer, ids: Sequence[int], num_tokens: int) -> int:
        """Run the deferred steps up to ``num_tokens`` tokens; ``len(text)`` after that one."""
        while self.pending and self.pending[0] <= num_tokens:
            k = self.pending.popleft()
            self.step(tokenizer, ids, k)
            self.ends[k] = len(self.text)
        return self.ends[num_tokens]

    def step(self, tokenizer, ids: Sequence[int], end: int | None = None) -> str:
        """Text added by the tokens ``ids[:end]`` (all of them by default) beyond those seen so far."""
        end = len(ids) if end is None else end
        prefix = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = tokenizer.decode(ids[self.prefix_offset : end], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = end
            self.text += delta
            return delta
        return ""


def emit_delta(detok: Detokenizer, stops: Sequence[str], finished: bool) -> str:
    """New text safe to send: text that could still turn out to start a stop string is held back."""
    end = len(detok.text)
    if stops and not finished:
        text = detok.text
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    end = min(end, len(text) - k)
                    break
    end = max(end, detok.sent)
    delta = detok.text[detok.sent : end]
    detok.sent = end
    return delta


def find_stop(text: str, stops: Sequence[str], added: int) -> int | None:
    """Where the earliest stop string starts among the last ``added`` characters' reach, or None."""
    window = max(len(s) for s in stops) + added
    tail_start = max(0, len(text) - window)
    cut = None
    for stop in stops:
        i = text.find(stop, tail_start)
        if i != -1 and (cut is None or i < cut):
            cut = i
    return cut

"""Input budgets: refuse a prompt longer than the context after a bounded amount of tokenising, not all of it.

A 3 MB chat body of emoji passes any sane character cap (262,144 characters here) and tokenises to
786,000 tokens in about 2.4 s, only to be refused for its length; four such bodies held a small request
behind them for 15 s (issue 22). :func:`tokens_over_budget` counts a text's tokens piece by piece and stops
as soon as the count passes the budget, so an over-long prompt costs about ``budget`` tokens of work. Text of
at most ``budget`` UTF-8 bytes is never counted: a byte-level tokenizer makes at most one token per byte
(sentencepiece with byte fallback likewise), so it cannot be over.

Pieces end at whitespace where there is some near the cut (a GPT-2-style pre-tokenizer splits there too, so
the pieces tokenise as they would in one run) and a piece may add a few tokens at its edges (a BOS token,
a split word): ``slack_per_piece`` tokens per piece are allowed before a prompt counts as over, so a prompt
that fits is never refused here. The exact check is the engine's, on the real token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

PIECE_CHARS = 2048  # characters tokenised at a time (about 450 English tokens; 2,048 emoji are 6,144)
SLACK_PER_PIECE = 4


def utf8_len(text: str) -> int:
    """UTF-8 bytes of ``text`` without encoding it (a lone surrogate counts as its 3-byte encoding)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _pieces(text: str, piece_chars: int):
    start, n = 0, len(text)
    while start < n:
        end = min(start + piece_chars, n)
        if end < n:
            cut = text.rfind(" ", start + piece_chars // 2, end)  # before a space: where pre-tokenizers split
            if cut > start:
                end = cut
        yield text[start:end]
        start = end


def tokens_over_budget(
    encode: Callable[[str], list[int]],
    texts: Iterable[str],
    budget: int,
    piece_chars: int = PIECE_CHARS,
    slack_per_piece: int = SLACK_PER_PIECE,
) -> int | None:
    """Tokens counted when ``texts`` (one prompt's, e.g. the contents of its messages) surely exceed
    ``budget`` tokens, or None when they may fit. Stops counting at the first piece past the budget."""
    texts = [t for t in texts if t]
    if sum(utf8_len(t) for t in texts) <= budget:
        return None
    counted = pieces = 0
    for text in texts:
        for piece in _pieces(text, piece_chars):
            counted += len(encode(piece))
            pieces += 1
            if counted > budget + slack_per_piece * pieces:
                return counted
    return None

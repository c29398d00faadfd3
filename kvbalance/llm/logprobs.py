"""Logprobs in OpenAI's two shapes, with each token's true bytes: one builder for the server's responses
(``server/routes.py``) and the Batch API's (``offline/batch_responses.py``), so both answer alike.

A byte-level BPE token can be part of a UTF-8 character (``decode([id])`` gives U+FFFD for all of them),
so ``TokenText`` maps a token id to its exact bytes: through the GPT-2 byte alphabet for byte-level
vocabularies, ``<0xNN>`` byte-fallback pieces and ``▁`` for SentencePiece ones, and the decoded text
otherwise. The display string is those bytes as UTF-8 with undecodable bytes written ``\\xNN``, so two
different tokens never share one; in a completion's ``top_logprobs`` dict, a token whose string is taken
already is keyed ``token_id:N``, so every alternative is kept.
"""

from __future__ import annotations

import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder(tokenizer) -> dict[str, int] | None:
    """Char -> byte of the GPT-2 byte alphabet when ``tokenizer`` is byte-level, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """Token id -> (display string, UTF-8 bytes). ``token_id:N`` for models without a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_decoder = _byte_decoder(tokenizer) if tokenizer is not None else None
        self._pieces = hasattr(tokenizer, "convert_ids_to_tokens")
        self._cache: dict[int, tuple[str, bytes]] = {}

    def token_bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(int(token_id)) if self._pieces else None
        if isinstance(piece, str) and piece:
            if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            if self._byte_decoder is None and "\u2581" in piece:  # SentencePiece word boundary
                return piece.replace("\u2581", " ").encode("utf-8")
        return tok.decode([int(token_id)]).encode("utf-8")

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            if self.tokenizer is None:
                hit = (f"token_id:{token_id}", f"token_id:{token_id}".encode())
            else:
                raw = self.token_bytes(token_id)
                hit = (raw.decode("utf-8", errors="backslashreplace"), raw)
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = hit
        return hit


def completion_logprobs(lps: list, to_text: TokenText, text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token: logprob} dicts."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s, _ = to_text(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in zip(lp.top_ids, lp.top_logprobs):
            key, _ = to_text(t)
            top[f"token_id:{t}" if key in top else key] = v
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(lps: list, to_text: TokenText) -> dict:
    """The chat shape: one entry per token with its bytes and a list of alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        s, raw = to_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(raw)}

    content = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content}

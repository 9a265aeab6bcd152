"""Where the steps of a response end, read from its tokens: one rule for the step-labelled training rows of a
process reward model and for the responses it scores in RL, so the model is read at the tokens it was
trained at.

A response's steps are joined by a separator ("\\n" by default, TRL's ``step_separator``). Step k ends at the
token in which the k-th separator ends; the last step ends at the response's last token (its EOS or
end-of-turn, where the outcome reward is read too). Tokens are matched through their own decoded text, so
a separator merged with its neighbours into one token, or split over two, is found all the same.
"""

from __future__ import annotations

import bisect
import itertools


class TokenText:
    """Each token's own decoded text (special tokens kept), cached per id: ``TokenText(tokenizer)(ids)``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, ids) -> list[str]:
        out = []
        for token in ids:
            token = int(token)
            if token not in self._text:
                self._text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
            out.append(self._text[token])
        return out


def separator_ends(pieces: list[str], separator: str) -> list[int]:
    """The index of the token in which each occurrence of ``separator`` ends (left to right, not
    overlapping) in the text the ``pieces`` (each token's text, in order) make together."""
    text = "".join(pieces)
    ends = list(itertools.accumulate(len(piece) for piece in pieces))  # the end (exclusive) of each token's text
    out, start = [], 0
    while (found := text.find(separator, start)) >= 0:
        last_char = found + len(separator) - 1
        out.append(bisect.bisect_right(ends, last_char))
        start = found + len(separator)
    return out


def step_end_tokens(pieces: list[str], separator: str) -> list[int]:
    """The token that ends each step of a response (``core.step_end_mask`` on token ids): where each
    separator ends, and the last token (unless a separator ends there already)."""
    ends = separator_ends(pieces, separator)
    if pieces and (not ends or ends[-1] != len(pieces) - 1):
        ends.append(len(pieces) - 1)
    return ends

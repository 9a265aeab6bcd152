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
    """Each token's own decoded text (special tokens kept), cached per id: ``TokenText(tokenizer)(ids)``.
    A token is decoded after a fixed anchor token and its text read after the anchor's: decoded alone, a
    SentencePiece (Metaspace) token loses its leading space, and Math-Shepherd's " ки" step tag is never found."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._anchor = list(tokenizer.encode("a", add_special_tokens=False))[-1:]  # none: each token alone
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)

    def __call__(self, ids) -> list[str]:
        out = []
        for token in ids:
            token = int(token)
            if token not in self._text:
                both = self.tokenizer.decode([*self._anchor, token], skip_special_tokens=False)
                if not both.startswith(self._anchor_text):  # the pair decoded into one another: the token alone
                    both = self._anchor_text + self.tokenizer.decode([token], skip_special_tokens=False)
                self._text[token] = both[len(self._anchor_text) :]
            out.append(self._text[token])
        return out


def separator_ends(pieces: list[str], separator: str) -> list[int]:
    """The index of the token in which each occurrence of ``separator`` ends (left to right, not
    overlapping) in the text the ``pieces`` (each token's text, in order) make together, counting only a
    separator with non-blank text since the previous one (or the start)."""
    text = "".join(pieces)
    ends = list(itertools.accumulate(len(piece) for piece in pieces))  # the end (exclusive) of each token's text
    out, start, prev = [], 0, 0
    while (found := text.find(separator, start)) >= 0:
        if text[prev:found].strip():  # an empty step ends nothing: training rows have none, and RL must not pay for it
            out.append(bisect.bisect_right(ends, found + len(separator) - 1))
        prev = start = found + len(separator)
    return out


def last_step_open(pieces: list[str], separator: str, special=()) -> bool:
    """Whether text other than whitespace and special tokens (``special``: their texts, as the EOS) follows
    the last ``separator`` in the ``pieces`` (or makes them up, without one): only then does the last token
    end a step, so "a\\nb\\n<eos>" has two steps, not a third empty one at its EOS."""
    special = set(special)
    text = "".join(piece for piece in pieces if piece not in special)
    last = text.rfind(separator)
    return bool(text[last + len(separator) if last >= 0 else 0 :].strip())


def step_end_tokens(pieces: list[str], separator: str) -> list[int]:
    """The token that ends each step of a response (``core.step_end_mask`` on token ids): where each
    separator ends, and the last token (unless a separator ends there already)."""
    ends = separator_ends(pieces, separator)
    if pieces and (not ends or ends[-1] != len(pieces) - 1):
        ends.append(len(pieces) - 1)
    return ends

"""Rows trained throughout rather than split into one prompt and one completion: language-modelling
text (every token) and multi-turn conversations (every assistant turn).

A conversation's loss mask comes from rendering it with the chat template turn by turn: the text
each assistant message adds after ``add_generation_prompt`` is trained (TRL's ``assistant_only_loss``),
the text before it is not.
"""

from __future__ import annotations

from posttrain.data.encode import Encoded, Encoder
from posttrain.data.rows import DataError


def encode_whole(encoder: Encoder, value, where: str) -> tuple[Encoded, list[int]] | None:
    """(ids split at the first trained token, loss mask over the completion ids) of a text or a conversation.

    Over ``max_length`` the end is cut (truncate), the row dropped (drop) or a ``DataError`` raised (error);
    None when dropped or when no trained token is left.
    """
    if isinstance(value, str):
        tokenizer = encoder.tokenizer
        ids = tokenizer(value, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
        mask = [0] + [1] * (len(ids) - 1)  # the first token is never predicted
    else:
        ids, mask = _conversation(encoder, value, where)
    truncated = encoder.max_length is not None and len(ids) > encoder.max_length
    if truncated:
        if encoder.overlong == "error":
            field = "text" if isinstance(value, str) else "messages"
            raise DataError(where, field, f"{len(ids)} tokens, more than the {encoder.max_length} allowed")
        if encoder.overlong == "drop":
            return None
        ids, mask = ids[: encoder.max_length], mask[: encoder.max_length]
    if 1 not in mask:
        return None
    first = max(mask.index(1), 1)
    return Encoded(ids[:first], ids[first:], truncated), mask[first:]


def _conversation(encoder: Encoder, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a mask that is 1 on what each assistant turn adds."""
    if not encoder.use_template:
        raise DataError(where, "messages", "a list of messages needs a tokenizer with a chat template")
    render = encoder.tokenizer.apply_chat_template
    pieces: list[tuple[str, int]] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:k], add_generation_prompt=True, tokenize=False)
        after = render(messages[: k + 1], tokenize=False)
        if not before.startswith(done) or not after.startswith(before):
            raise DataError(where, f"messages[{k}]", "the chat template renders earlier turns differently later on")
        pieces += [(before[len(done) :], 0), (after[len(before) :], 1)]
        done = after
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        piece = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask

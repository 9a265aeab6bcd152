"""Turning prompts and completions into token ids: chat templates, EOS, and over-long rows.

With a chat template the prompt is rendered with ``add_generation_prompt=True`` and the completion
is the text the full conversation adds after it, so the template's own end-of-turn tokens are part
of the completion and get trained; whitespace a template renders after its end-of-turn token
(Qwen's ``<|im_end|>\\n``) is left out, because generation stops at that token: the reward model
is then trained reading the score at the token PPO reads it at. Without a template, prompt and
completion are concatenated and the EOS token is appended to the completion: the model must learn
to stop (docs/pitfalls.md #7).

Over-long rows follow ``overlong``: ``truncate`` shortens the prompt's text from the left (its
start is the part furthest from the answer) and renders it again, so the template stays intact
(docs/pitfalls.md #17), then cuts the completion on the right; ``drop`` drops the row; ``error`` raises.
A row left without completion tokens is dropped, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.data.rows import DataError

OVERLONG_POLICIES = ("truncate", "drop", "error")
CHAT_TEMPLATE_MODES = ("auto", "always", "never")


@dataclass
class Encoded:
    prompt_ids: list[int]
    completion_ids: list[int]
    truncated: bool = False


class Encoder:
    """Renders and tokenizes rows for one tokenizer and one set of length limits."""

    def __init__(
        self,
        tokenizer,
        chat_template: str = "auto",
        max_length: int | None = None,
        max_prompt_length: int | None = None,
        overlong: str = "truncate",
    ):
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {chat_template!r}")
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "always" and not has_template:
            raise ValueError("chat_template='always' but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.use_template = has_template and chat_template != "never"
        self.max_length = max_length
        self.overlong = overlong
        budgets = [b for b in (max_prompt_length, None if max_length is None else max_length - 1) if b is not None]
        self.prompt_budget = min(budgets) if budgets else None

    # -- rendering ---------------------------------------------------------------------------------

    def _messages(self, prompt, where: str, field: str) -> list[dict]:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if not self.use_template:
            raise DataError(where, field, "a list of messages needs a tokenizer with a chat template")
        return prompt

    def _prompt_text(self, prompt, where: str) -> str:
        if self.use_template:
            return self.tokenizer.apply_chat_template(
                self._messages(prompt, where, "prompt"), add_generation_prompt=True, tokenize=False
            )
        if not isinstance(prompt, str):
            raise DataError(where, "prompt", "a list of messages needs a tokenizer with a chat template")
        return prompt

    def _tokenize_prompt(self, prompt, where: str) -> list[int]:
        text = self._prompt_text(prompt, where)
        # a rendered template already holds its BOS; plain text gets the tokenizer's special tokens
        return self.tokenizer(text, add_special_tokens=not self.use_template)["input_ids"]

    def _completion_ids(self, prompt, completion, where: str, field: str) -> list[int]:
        if not self.use_template:
            if not isinstance(completion, str):
                raise DataError(where, field, "a list of messages needs a tokenizer with a chat template")
            ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
            return ids + [self.tokenizer.eos_token_id]
        prompt_messages = self._messages(prompt, where, "prompt")
        reply = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        prompt_text = self.tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=False)
        full_text = self.tokenizer.apply_chat_template(prompt_messages + reply, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise DataError(where, field, "the chat template renders the prompt differently once a reply follows")
        ids = self.tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
        return self._end_at_end_of_turn(ids)

    def completion(self, prompt, completion, where: str = "<row>", field: str = "completion") -> list[int]:
        """Token ids of ``completion`` as it follows ``prompt`` (the template's end of turn, or EOS appended
        without a template), not cut: the response after a prompt encoded on its own by ``prompt``."""
        return self._completion_ids(prompt, completion, where, field)

    def _end_at_end_of_turn(self, ids: list[int]) -> list[int]:
        """The completion up to its last special token when only whitespace follows it.

        Templates such as Qwen's render ``<|im_end|>\\n``: the model stops at ``<|im_end|>`` (an EOS id),
        so a rollout ends there and PPO reads the reward model at it. Training on the ``\\n`` too
        would teach the reward model to score at a token it never sees in RL.
        """
        special = set(self.tokenizer.all_special_ids)
        last = max((i for i, token in enumerate(ids) if token in special), default=None)
        if last is None or self.tokenizer.decode(ids[last + 1 :]).strip():
            return ids
        return ids[: last + 1]

    # -- length limits -----------------------------------------------------------------------------

    def _overlong(self, where: str, field: str, n: int, budget: int) -> None:
        if self.overlong == "error":
            raise DataError(where, field, f"{n} tokens, more than the {budget} allowed (overlong='error')")

    def _shorten_prompt(self, prompt, where: str, budget: int) -> list[int] | None:
        """The prompt with the start of its (last message's) text cut so that it fits; None if nothing fits."""

        def with_text(text: str):
            if isinstance(prompt, str):
                return text
            return prompt[:-1] + [{**prompt[-1], "content": text}]

        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        lo, hi = 0, len(text)  # the largest number of trailing characters that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._tokenize_prompt(with_text(text[len(text) - mid :]), where)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        return self._tokenize_prompt(with_text(text[len(text) - lo :]), where)

    def prompt(self, prompt, where: str = "<row>", budget: int | None = None) -> Encoded | None:
        """Token ids of a prompt (for RL), fitted to ``budget`` (default: the prompt budget). None = dropped."""
        budget = self.prompt_budget if budget is None else budget
        ids = self._tokenize_prompt(prompt, where)
        if budget is None or len(ids) <= budget:
            return Encoded(ids, [])
        self._overlong(where, "prompt", len(ids), budget)
        if self.overlong == "drop":
            return None
        shortened = self._shorten_prompt(prompt, where, budget)
        return None if shortened is None else Encoded(shortened, [], truncated=True)

    def pair(self, prompt, completion, where: str = "<row>", field: str = "completion") -> Encoded | None:
        """Token ids of prompt + completion within the limits. None = dropped (over-long or no completion left).

        When the row is too long the prompt gives way first, down to half of ``max_length`` (or to
        ``max_prompt_length`` when that is smaller); then the completion is cut on the right.
        """
        completion_ids = self._completion_ids(prompt, completion, where, field)
        if self.overlong != "truncate":
            encoded = self.prompt(prompt, where)  # raises or drops when the prompt alone is too long
            total = None if encoded is None else len(encoded.prompt_ids) + len(completion_ids)
            if total is not None and self.max_length is not None and total > self.max_length:
                self._overlong(where, field, total, self.max_length)
                return None
            if encoded is not None:
                encoded.completion_ids = completion_ids
            return encoded
        budget = self.prompt_budget
        if self.max_length is not None:
            budget = min(budget, max(self.max_length - len(completion_ids), self.max_length // 2))
        encoded = self.prompt(prompt, where, budget)
        if encoded is None:
            return None
        if self.max_length is not None and len(encoded.prompt_ids) + len(completion_ids) > self.max_length:
            completion_ids = completion_ids[: self.max_length - len(encoded.prompt_ids)]
            encoded.truncated = True
        if not completion_ids:
            return None
        encoded.completion_ids = completion_ids
        return encoded

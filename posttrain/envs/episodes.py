"""Episodes as token rows: the model's turns exactly as sampled, the environment's messages rendered by the
chat template between them, one mask telling them apart.

Row of one episode (docs/algorithms/multi_turn.md draws it)::

    [pad … pad | prompt (template) | turn 1 (model) | glue + tool message + glue | turn 2 (model) | pad …]
     prompt_mask: 0 … 0 1 … 1      response_mask: 1 on every token of the episode, 0 on the padding
                                    sampled_mask:  1 on the model's turns only (EOS included), 0 elsewhere

The model's ids are never decoded and encoded again (a BPE tokenizer would give other ids for the same
text, and the training forward would score tokens the policy never sampled); only the environment's part
is tokenized, from the template's rendering of the messages it adds. All episodes of a batch that are
still running are sampled together, one engine call per turn, whatever turn each is at; the environment
then answers them one after another, or as many at a time as its ``concurrent_steps`` says it may (the
python environment: each program is its own sandboxed process; function tools: each call its own worker),
in threads, the answers kept in the episodes' order.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from posttrain.envs.base import EnvConfig, Environment, EpisodeState, StepResult, env_columns
from posttrain.errors import UserError
from posttrain.rollout.base import Rollout, RolloutEngine, SamplingParams, left_pad

MARK = "\x00posttrain-turn\x00"  # a stand-in turn, found again in the rendering to cut the template there


def first_messages(env: Environment, row: dict) -> list[dict]:
    """``env.reset(row)``, checked: a list of chat messages ({"role": ..., "content": ...})."""
    messages = env.reset(row)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise UserError(
            f"env: {type(env).__name__}.reset must return a list of chat messages "
            f'[{{"role": "user", "content": ...}}, ...], got {messages!r:.200}'
        )
    return messages


def check_fits(ids: list[int], config: EnvConfig, context: int | None, row: dict) -> None:
    """ValueError when an episode's first prompt ``ids`` and ``env.max_episode_tokens`` do not fit the model's
    ``context`` positions (None: unknown, not checked), saying which of the two to change."""
    if context is None or len(ids) + config.max_episode_tokens <= context:
        return
    prompt = f"the prompt {str(row.get('prompt'))[:80]!r} is {len(ids)} tokens with the environment's messages"
    if len(ids) >= context:
        raise ValueError(
            f"env: {prompt} (a system message, the tools' descriptions), more than the model's {context} positions: "
            "offer fewer or shorter tools, a shorter env.kwargs.system, or use a model with a longer context"
        )
    raise ValueError(
        f"env: {prompt}; with env.max_episode_tokens={config.max_episode_tokens} after it, an episode does not fit "
        f"the model's {context} positions: lower env.max_episode_tokens to {context - len(ids)} or less"
    )


def render(tokenizer, messages: list[dict], tools, generation_prompt: bool) -> str:
    """The chat template's text of ``messages`` (with the tools' descriptions when ``tools``)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)


def prompt_ids(tokenizer, messages: list[dict], tools) -> list[int]:
    """The first messages of an episode rendered for the model's first turn (the template holds its BOS)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("env: episodes are rendered through the chat template, and this tokenizer has none")
    return tokenizer(render(tokenizer, messages, tools, True), add_special_tokens=False)["input_ids"]


def followup_ids(tokenizer, messages: list[dict], tools, ended_with: str) -> list[int]:
    """The tokens between a model turn and the next: what the template writes after a turn's text, less
    ``ended_with`` (the text of the end-of-turn token the model sampled, which the row already holds), then
    ``messages`` (the environment's) and the next turn's header. Rendered after a stand-in conversation:
    the template's text for these messages does not depend on what the turns before said."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}]
    before = render(tokenizer, base, tools, False)
    after = render(tokenizer, base + messages, tools, True)
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders a conversation differently once tool messages follow; episodes need a "
            "template that appends each message"
        )
    closing = before[before.rindex(MARK) + len(MARK) :]
    if ended_with and closing.startswith(ended_with):
        closing = closing[len(ended_with) :]
    return tokenizer(closing + after[len(before) :], add_special_tokens=False)["input_ids"]


class _Episode:
    """The token row of one running episode after its prompt: ids, which the model sampled, their log-probs."""

    def __init__(self, state: EpisodeState, prompt: list[int]):
        self.state, self.prompt = state, prompt
        self.ids: list[int] = []
        self.sampled: list[int] = []
        self.logprobs: list[float] = []
        self.truncated = False
        self.unscored = False  # a turn came without the sampler's log-probs: the trainer recomputes them all
        self.last_turn = ""  # the text of the model's last turn (special tokens removed)
        self.last_token: int | None = None  # and its last token

    def append(self, ids: list[int], logprobs: list[float] | None, sampled: bool) -> None:
        self.ids += ids
        self.sampled += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.unscored |= sampled and logprobs is None

    def end(self, why: str) -> None:
        self.state.end = why


def run_episodes(
    engine: RolloutEngine,
    env: Environment,
    config: EnvConfig,
    tokenizer,
    rows: list[dict],
    params: SamplingParams,
    n: int,
    context: int | None = None,
) -> Rollout:
    """``n`` episodes from each of ``rows`` (consecutive, as a rollout's groups), every running episode's
    next turn sampled in one ``engine.generate`` call. Returns the rollout of the episodes: ``response_ids``
    the whole episode after its prompt, ``sampled_mask`` the model's tokens, ``responses`` the model's last
    turn (what the reward functions read), ``columns`` the rows' and the episodes' (``env_columns``).
    ``context``: the model's positions; a first prompt that leaves less than ``env.max_episode_tokens`` of
    them is refused (ValueError)."""
    episodes = []
    for row in rows:
        first = first_messages(env, row)
        ids = prompt_ids(tokenizer, first, env.tools)
        check_fits(ids, config, context, row)
        episodes += [_Episode(EpisodeState(row, [dict(m) for m in first]), ids) for _ in range(n)]
    special = set(tokenizer.all_special_ids)
    workers = max(1, getattr(env, "concurrent_steps", 1))
    while running := [e for e in episodes if not e.state.end]:
        budget = max(config.max_episode_tokens - len(e.ids) for e in running)
        limit = max(1, min(params.max_new_tokens, budget))
        turn = replace(params, max_new_tokens=limit, min_new_tokens=min(params.min_new_tokens, limit))
        out = engine.generate([e.prompt + e.ids for e in running], turn, n=1)
        answering = []
        for j, episode in enumerate(running):
            keep = out.response_mask[j].bool()
            logprobs = None if out.logprobs is None else out.logprobs[j][keep].tolist()
            if _model_turn(
                episode, out.response_ids[j][keep].tolist(), logprobs, bool(out.truncated[j]), config, tokenizer
            ):
                answering.append(episode)
        with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
            results = (pool.map if pool else map)(lambda e: _step(env, e.state, e.last_turn), answering)
            for episode, result in zip(answering, results, strict=True):
                _answer(episode, result, env, config, tokenizer, special)
    return _rollout(episodes, rows, n, tokenizer, config, params.logprob_temperature)


def _model_turn(episode: _Episode, ids, logprobs, cut: bool, config: EnvConfig, tokenizer) -> bool:
    """Append one sampled turn to ``episode``; False when it ends the episode (cut by a token limit)."""
    state = episode.state
    room = config.max_episode_tokens - len(episode.ids)
    if len(ids) > room:  # the turn was sampled with the batch's largest budget: its own ends sooner
        ids, logprobs, cut = ids[:room], None if logprobs is None else logprobs[:room], True
    episode.append(ids, logprobs, sampled=True)
    episode.last_turn = tokenizer.decode(ids, skip_special_tokens=True)
    episode.last_token = ids[-1] if ids else None
    state.messages.append({"role": "assistant", "content": episode.last_turn})
    state.turns += 1
    if cut:
        episode.truncated = True
        episode.end("max_tokens")
    return not cut


def _step(env: Environment, state: EpisodeState, turn: str) -> StepResult:
    """``env.step``, timed into the episode's ``env_seconds`` and checked (``checked_step``). An environment
    of your own that raises stops the run in one line naming it, where it raised and the turn; a shipped
    one never raises on model text, so an exception from it is a bug and keeps its traceback."""
    start = time.perf_counter()
    try:
        result = env.step(state, turn)
    except Exception as error:
        if type(env).__module__.startswith("posttrain."):
            raise
        frame = traceback.extract_tb(error.__traceback__)[-1]
        why = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        raise UserError(
            f"env: {type(env).__name__}.step raised {why} ({Path(frame.filename).name}:{frame.lineno}) "
            f"on the model's turn {turn!r:.100}"
        ) from error
    finally:
        state.env_seconds += time.perf_counter() - start
    return checked_step(env, result, turn)


def checked_step(env: Environment, result, turn: str) -> StepResult:
    """``result`` of ``env.step(state, turn)`` when it is a ``StepResult`` the runner can use; else a one-line
    ``UserError`` naming the environment's class, what it returned and what is expected."""
    if not isinstance(result, StepResult):
        what = "None" if result is None else f"a {type(result).__name__}"
        problem = f"returned {what}; it must return a StepResult (posttrain.envs.StepResult)"
    elif result.reward is not None and not (
        isinstance(result.reward, numbers.Real) and not isinstance(result.reward, bool) and math.isfinite(result.reward)
    ):
        problem = f"returned reward={result.reward!r:.60}; a reward is a number or None (the turn is not scored)"
    elif not isinstance(result.messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in result.messages
    ):
        problem = (
            f"returned messages={result.messages!r:.100}; messages are a list of chat messages "
            '[{"role": "tool", "content": ...}]'
        )
    elif not all(type(n) is int and n >= 0 for n in (result.tool_calls, result.tool_errors)):
        counts = f"tool_calls={result.tool_calls!r:.20}, tool_errors={result.tool_errors!r:.20}"
        problem = f"returned {counts}; both are counts (int >= 0)"
    else:
        return result
    raise UserError(f"env: {type(env).__name__}.step {problem} (on the model's turn {turn!r:.100})")


def _answer(episode: _Episode, result: StepResult, env, config: EnvConfig, tokenizer, special) -> None:
    """The environment's answer to the episode's last turn: its messages appended as tokens, or the end."""
    state = episode.state
    state.tool_calls += result.tool_calls
    state.tool_errors += result.tool_errors
    state.rewards.append(result.reward)
    if result.done:
        return episode.end("tool_error" if result.tool_errors and config.on_tool_error == "stop" else "model")
    if state.turns >= config.max_turns:
        return episode.end("max_turns")
    ended_with = tokenizer.decode([episode.last_token]) if episode.last_token in special else ""
    glue = followup_ids(tokenizer, result.messages, env.tools, ended_with)
    if len(episode.ids) + len(glue) >= config.max_episode_tokens:  # no room left for another turn
        return episode.end("max_tokens")
    episode.append(glue, None, sampled=False)
    state.messages.extend(result.messages)


def _rollout(episodes: list[_Episode], rows: list[dict], n: int, tokenizer, config: EnvConfig, temperature) -> Rollout:
    """The ``Rollout`` of finished episodes (prompts left-padded, episodes right-padded)."""
    pad = tokenizer.pad_token_id
    prompt_ids_, prompt_mask = left_pad([e.prompt for e in episodes], pad)
    T = max(len(e.ids) for e in episodes)

    def right(values: list, fill) -> list:
        return values + [fill] * (T - len(values))

    response_ids = torch.tensor([right(e.ids, pad) for e in episodes], dtype=torch.long)
    response_mask = torch.tensor([right([1] * len(e.ids), 0) for e in episodes], dtype=torch.long)
    sampled = torch.tensor([right(e.sampled, 0) for e in episodes], dtype=torch.long)
    logprobs = torch.tensor([right(e.logprobs, 0.0) for e in episodes], dtype=torch.float32)
    keys = sorted({k for row in rows for k in row if k != "prompt"})
    columns = {k: [row.get(k) for row in rows for _ in range(n)] for k in keys}
    columns.update(env_columns([e.state for e in episodes], config))
    return Rollout(
        prompt_ids=prompt_ids_,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=None if any(e.unscored for e in episodes) else logprobs,
        truncated=torch.tensor([e.truncated for e in episodes]),
        prompt_index=torch.arange(len(rows)).repeat_interleave(n),
        prompts=[tokenizer.decode(e.prompt, skip_special_tokens=True) for e in episodes],
        responses=[e.last_turn for e in episodes],
        group_size=n,
        temperature=temperature,
        columns=columns,
        sampled_mask=sampled,
    )

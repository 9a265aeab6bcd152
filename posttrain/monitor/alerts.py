"""Health alerts: rules over the metrics a PPO/GRPO run logs, evaluated after every step; one over every
trainer's (``DEAD_RUN_RULES``: a zero gradient or a loss that does not move, a dead run), and one more
over an SFT run's (``SFT_RULES``: a loss stuck at ln V).

Each rule reads the history of logged records (``History``: what the rules need of them, in memory
bounded by the window) and returns what it saw, or None.
An alert is raised when its rule starts to hold (again after it stopped holding), printed to the
console and written to ``alerts.jsonl`` with the likely causes and what to try. Those two sentences
are the troubleshooting answers of the RLHF notes this project follows (KL too large or too small,
ratios outside the clip range, value loss, length bias, rise-then-collapse, ...).

Trend rules compare the first and second half of the last ``window`` steps and stay silent until
that many steps are logged; level rules look at the current step (or the window mean, where one
step is noise).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class AlertConfig:
    """Thresholds of the health alerts (``alerts.<name>=...``)."""

    enabled: bool = True
    """Evaluate the rules after every step (console, progress bar, alerts.jsonl)."""
    window: int = 10
    """Steps a trend rule looks back over (the first and second half of them are compared)."""
    kl_max: float = 0.5
    """1: KL to the reference per token (nats) above this is too large."""
    kl_rise: float = 0.1
    """1: KL per token rising by more than this (nats) within the window is rising fast."""
    kl_tiny: float = 1e-3
    """2: KL per token below this over the whole window is tiny..."""
    reward_flat: float = 0.05
    """2: ...while the reward moved less than this many batch standard deviations over the window."""
    clipfrac_max: float = 0.3
    """3: mean clip fraction over the window above this."""
    ratio_mean_tol: float = 0.2
    """3: mean |ratio_mean − 1| over the window above this."""
    first_ratio_tol: float = 0.02
    """4: at the first minibatch (before any update) max |ratio − 1| above this: sampler and trainer disagree."""
    explained_variance_min: float = 0.0
    """5: mean explained variance of the values over the window below this (after the first window)."""
    value_loss_growth: float = 3.0
    """5: value loss in the second half of the window above this multiple of the first half's."""
    length_growth: float = 0.2
    """6: mean response length grew by more than this share over the window..."""
    length_corr: float = 0.5
    """6: ...and its correlation with the training reward across the window's steps is at least this."""
    eval_drop: float = 0.05
    """7: held-out score this far below its best (step 0 included) while the training reward rose since (medians of
    window/2 + 1 steps, by more than ``reward_flat`` batch std),"""
    eval_collapse: float = 0.15
    """7: ...or this far below it whatever the training reward does (in the score's units: accuracy for 0/1 rewards)."""
    entropy_collapse: float = 0.1
    """8: mean entropy over the window below this share of the first window's."""
    zero_variance_max: float = 0.5
    """9: mean share of groups whose rewards are all equal, over the window, above this."""
    truncation_max: float = 0.2
    """10: mean share of responses cut at max_new_tokens, over the window, above this (15: and...)."""
    limit_length_corr: float = 0.3
    """15: ...the mean within-batch correlation of score and response length over the window at least this, while
    the score rises: the reward pays for length at the limit (PPO logs it, ``score/length_corr``)."""
    offpolicy_clipped_max: float = 0.2
    """14: mean share of tokens whose importance weight was capped or masked, over the window, above this..."""
    offpolicy_gap_growth: float = 2.0
    """14: ...or the sampler/trainer log-prob gap's second half-window above this multiple of its first."""

    def validate(self, name: str = "alerts") -> None:
        if self.window < 2:
            raise ValueError(f"{name}.window must be >= 2, got {self.window}")
        for key in ("zero_variance_max", "truncation_max", "entropy_collapse", "clipfrac_max", "offpolicy_clipped_max"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{name}.{key} must be in [0, 1], got {getattr(self, key)}")
        for key in ("length_corr", "limit_length_corr"):
            if not -1 <= getattr(self, key) <= 1:
                raise ValueError(f"{name}.{key} must be in [-1, 1], got {getattr(self, key)}")
        if not self.eval_collapse > 0:
            raise ValueError(
                f"{name}.eval_collapse must be > 0 (the held-out drop that alerts alone), got {self.eval_collapse}"
            )


@dataclass(frozen=True)
class Rule:
    id: int
    name: str
    check: Callable[[History, AlertConfig, dict], str | None]
    causes: str
    remedy: str


# --------------------------------------------------------------------------------------------------
# what the rules read of the history, in memory bounded by the window
# --------------------------------------------------------------------------------------------------

EVAL_KEYS = ("eval/greedy/score", "eval/sampled/score")
"""Held-out scores rule 7 compares, the first one a run logs preferred."""

WATCHED = (
    "kl/per_token",
    "policy/clipfrac",
    "policy/ratio_mean",
    "values/explained_variance",
    "value_loss",
    "entropy",
    "groups/zero_variance_share",
    "truncated_share",
    "rollout/importance_clipped_share",
    "rollout/logprob_diff_mean",
    "score/length_corr",
)


def _finite(value) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _halves(values: list[float]) -> tuple[float, float]:
    half = len(values) // 2
    return _mean(values[:half]), _mean(values[half:])


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson correlation of two equally long lists (0 when either is constant)."""
    mx, my = _mean(x), _mean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0


@dataclass
class _EvalTrack:
    """One held-out score over the run: its best (the first of equal bests) and its latest value, each
    with the finite training rewards of the records from window/2 before it up to it. A best logged
    before any training reward (step 0's evaluation of the starting model) takes as many as that from the
    rewards logged after it instead (``filling`` until it has them): the steps that sample from a model
    close to it, several of them, since one batch's reward can be an outlier that hides a collapse.
    ``then_index``: the record of the last of them."""

    best: float
    best_step: int
    best_index: int
    then: list[float]
    now: float
    now_index: int
    recent: list[float]
    then_index: int
    filling: bool = False


class History:
    """What the rules read of the logged records (one dict per step), updated once per record.

    A rule needs the last ``window`` finite values of a metric, how many there were, the first window
    of them (entropy), the latest record, and for rule 7 the best and the latest held-out score with the
    training reward around each. Keeping exactly that, a step's check costs the same at step 10 and at
    step 100,000 (a list of every record, rescanned by every rule, cost more at every step, bench/README.md,
    and made a resume's replay of its records quadratic).
    """

    def __init__(self, window: int, reward: str, reward_std: str):
        self.window, self.reward = window, reward
        self.keys = tuple(dict.fromkeys((*WATCHED, reward, reward_std)))
        self.tails: dict[str, deque[float]] = {k: deque(maxlen=window) for k in self.keys}
        self.heads: dict[str, list[float]] = {k: [] for k in self.keys}
        self.counts: dict[str, int] = dict.fromkeys(self.keys, 0)
        self.length_reward: deque[tuple[float, float]] = deque(maxlen=window)
        self.rewards_near: deque[float | None] = deque(maxlen=window // 2 + 1)  # records, not finite values
        self.evals: dict[str, _EvalTrack] = {}
        self.updates: deque[dict] = deque(maxlen=DEAD_STEPS)  # rule 12: the last updates with something to learn
        self.first_loss: float | None = None  # rule 12: the loss of the first such update,
        self.loss_moved = False  # and whether a later one's has left it by more than LOSS_MOVED
        self.last: dict = {}
        self.index = -1

    def add(self, record: dict) -> None:
        self.last, self.index = record, self.index + 1
        if _has_something_to_learn(record):
            self.updates.append(record)
            loss = _finite(record.get("loss"))
            if self.first_loss is None:
                self.first_loss = loss
            elif loss is not None and abs(loss - self.first_loss) > LOSS_MOVED:
                self.loss_moved = True
        for key in self.keys:
            value = _finite(record.get(key))
            if value is None:
                continue
            self.tails[key].append(value)
            self.counts[key] += 1
            if len(self.heads[key]) < self.window:
                self.heads[key].append(value)
        reward = _finite(record.get(self.reward))
        if record.get("response_length/mean") is not None and reward is not None:
            self.length_reward.append((record["response_length/mean"], reward))
        self.rewards_near.append(reward)
        if reward is not None:
            for track in self.evals.values():
                if track.filling:  # a best with no reward before it (step 0): the first window/2 + 1 after it
                    track.then.append(reward)
                    track.filling, track.then_index = len(track.then) < self.rewards_near.maxlen, self.index
        for key in EVAL_KEYS:
            score = _finite(record.get(key))
            if score is None:
                continue
            near = [r for r in self.rewards_near if r is not None]
            track = self.evals.get(key)
            if track is None or score > track.best:
                track = self.evals[key] = _EvalTrack(
                    score, record.get("step"), self.index, [*near], score, self.index, near, self.index, not near
                )
            track.now, track.now_index, track.recent = score, self.index, near

    def full(self, key: str) -> list[float]:
        """The last ``window`` finite values of ``key``; [] until there are that many."""
        return list(self.tails[key]) if len(self.tails[key]) == self.window else []

    def tail(self, key: str) -> list[float]:
        """The last finite values of ``key``, at most ``window`` of them."""
        return list(self.tails[key])


# --------------------------------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------------------------------


def _kl_large(h: History, cfg, ctx):
    kl = h.tail("kl/per_token")
    if not kl:
        return None
    if kl[-1] > cfg.kl_max:
        return f"KL to the reference is {kl[-1]:.3g} nats/token (> {cfg.kl_max})"
    if len(kl) == cfg.window and kl[-1] - min(kl) > cfg.kl_rise:
        return f"KL per token rose from {min(kl):.3g} to {kl[-1]:.3g} within {cfg.window} steps"
    return None


def _kl_tiny_reward_flat(h: History, cfg, ctx):
    kl = h.full("kl/per_token")
    reward = h.full(ctx["reward"])
    std = h.full(ctx["reward_std"])
    if not kl or not reward or not std or max(abs(v) for v in kl) >= cfg.kl_tiny:
        return None
    first, second = _halves(reward)
    scale = max(_mean(std), 1e-8)
    if abs(second - first) < cfg.reward_flat * scale:
        return (
            f"KL per token stayed below {cfg.kl_tiny} and the reward moved {second - first:+.3g} "
            f"({(second - first) / scale:+.2f} batch std) over {cfg.window} steps"
        )
    return None


def _clipping(h: History, cfg, ctx):
    clipfrac = h.full("policy/clipfrac")
    ratio = h.full("policy/ratio_mean")
    if clipfrac and _mean(clipfrac) > cfg.clipfrac_max:
        return f"clip fraction {_mean(clipfrac):.2f} on average over {cfg.window} steps (> {cfg.clipfrac_max})"
    if ratio and _mean([abs(r - 1) for r in ratio]) > cfg.ratio_mean_tol:
        return f"mean ratio π/π_old is {ratio[-1]:.3g}, on average {cfg.ratio_mean_tol}+ away from 1"
    return None


def _first_ratio(h: History, cfg, ctx):
    record = h.last
    high, low = record.get("policy/first_minibatch_ratio_max"), record.get("policy/first_minibatch_ratio_min")
    if high is None or low is None:  # a step with nothing to train on (GRPO: nothing scored) logs no ratio
        return None
    off = max(abs(high - 1), abs(low - 1))
    if not off <= cfg.first_ratio_tol:  # NaN counts as off
        return f"before any update the ratio π/π_old spans [{low:.4g}, {high:.4g}] (should be exactly 1)"
    return None


def _critic(h: History, cfg, ctx):
    explained = h.tail("values/explained_variance")
    loss = h.full("value_loss")
    if h.counts["values/explained_variance"] >= 2 * cfg.window and _mean(explained) < cfg.explained_variance_min:
        return f"explained variance of the values is {_mean(explained):.3g} over {cfg.window} steps"
    if loss:
        first, second = _halves(loss)
        if second > cfg.value_loss_growth * first:
            return f"value loss grew from {first:.3g} to {second:.3g} within {cfg.window} steps"
    return None


def _length_bias(h: History, cfg, ctx):
    if len(h.length_reward) < cfg.window:
        return None
    length = [pair[0] for pair in h.length_reward]
    reward = [pair[1] for pair in h.length_reward]
    first, second = _halves(length)
    growth = (second - first) / max(first, 1e-8)
    corr = pearson(length, reward)
    if growth > cfg.length_growth and corr >= cfg.length_corr:
        return (
            f"mean response length grew {growth:+.0%} ({first:.3g} → {second:.3g} tokens) over {cfg.window} steps, "
            f"correlation with the reward {corr:.2f}"
        )
    return None


def _rise_then_collapse(h: History, cfg, ctx):
    key = next((k for k in EVAL_KEYS if k in h.evals), None)
    if key is None:
        return None
    track = h.evals[key]
    drop = track.best - track.now
    if track.now_index == track.best_index or drop < cfg.eval_drop:
        return None
    fell = f"held-out {key.split('/')[1]} score fell from {track.best:.3g} (step {track.best_step}) to {track.now:.3g}"
    # medians: one outlying batch among them (a lucky first batch) neither hides a rise nor makes one
    then, recent = (statistics.median(r) if r else None for r in (track.then, track.recent))
    reward = "" if then is None or recent is None else f"the training reward went from {then:.3g} to {recent:.3g}"
    # a rise is one beyond noise (rule 2's "moved"), seen by an evaluation after the baseline's rewards
    noise = cfg.reward_flat * _mean(h.tail(ctx["reward_std"])) if h.tail(ctx["reward_std"]) else 0.0
    if reward and not track.filling and track.now_index >= track.then_index and recent - then > noise:
        return f"{fell} while {reward.replace('went', 'rose')}"
    if drop >= cfg.eval_collapse:  # a large drop says the run got worse at the task, whatever the reward did
        return f"{fell}, {drop:.3g} below its best (alerts.eval_collapse={cfg.eval_collapse})" + (
            f"; {reward}" if reward else ""
        )
    return None


def _entropy_collapse(h: History, cfg, ctx):
    if h.counts["entropy"] < 2 * cfg.window:
        return None
    start, now = _mean(h.heads["entropy"]), _mean(h.tail("entropy"))
    if now < cfg.entropy_collapse * start:
        return f"entropy per token fell from {start:.3g} to {now:.3g} nats ({now / max(start, 1e-12):.0%})"
    return None


def _zero_variance(h: History, cfg, ctx):
    share = h.full("groups/zero_variance_share")
    if share and _mean(share) > cfg.zero_variance_max:
        return f"{_mean(share):.0%} of the groups had all-equal rewards (zero advantage) over {cfg.window} steps"
    return None


def _truncation(h: History, cfg, ctx):
    share = h.full("truncated_share")
    if ctx["forced_length"] or not share or _mean(share) <= cfg.truncation_max:
        return None
    return f"{_mean(share):.0%} of the responses hit max_new_tokens without EOS over {cfg.window} steps"


def _length_at_limit(h: History, cfg, ctx):
    """Rule 6 needs the length to grow, which stops once the responses reach max_new_tokens, and rule 10 says
    only that they do: here the score rises while most responses are cut and, within each batch, the longer
    responses score higher (``score/length_corr``: undefined, so not logged, in a batch of one length)."""
    share, reward, corr = h.full("truncated_share"), h.full(ctx["reward"]), h.tail("score/length_corr")
    if ctx["forced_length"] or not share or not reward or len(corr) < cfg.window // 2:
        return None
    first, second = _halves(reward)
    if _mean(share) <= cfg.truncation_max or _mean(corr) < cfg.limit_length_corr or second <= first:
        return None
    return (
        f"{_mean(share):.0%} of the responses hit max_new_tokens over {cfg.window} steps while the score rose "
        f"{first:.3g} → {second:.3g} and the longer responses of a batch scored higher (correlation {_mean(corr):.2f})"
    )


OFFPOLICY_GAP_FLOOR = 1e-3
"""14: a mean |log π_old − log π_behaviour| below this (nats per token) is float rounding, whatever its growth."""


def _off_policy_gap(h: History, cfg, ctx):
    clipped = h.full("rollout/importance_clipped_share")
    if clipped and _mean(clipped) > cfg.offpolicy_clipped_max:
        return (
            f"{_mean(clipped):.0%} of the tokens had their importance weight capped or masked over {cfg.window} steps"
        )
    gap = h.full("rollout/logprob_diff_mean")
    if gap:
        first, second = _halves(gap)
        if second > OFFPOLICY_GAP_FLOOR and second > cfg.offpolicy_gap_growth * first:
            return f"the sampler/trainer log-prob gap grew from {first:.3g} to {second:.3g} nats per token"
    return None


NON_FINITE_KEYS = ("policy/loss", "policy/pg_loss", "grad_norm", "critic_grad_norm", "value_loss")


def _non_finite(h: History, cfg, ctx):
    record = h.last
    # a GRPO step no reward function scored logs reward/mean NaN by design, with reward/applicable_share 0
    # (the trainer warns and stops after max_unscored_steps): that is no non-finite reward
    nothing_scored = record.get("reward/applicable_share") == 0
    keys = NON_FINITE_KEYS if nothing_scored else (*NON_FINITE_KEYS, ctx["reward"])
    bad = [k for k in keys if k in record and (record[k] is None or not math.isfinite(float(record[k])))]
    if bad:
        return "non-finite " + ", ".join(f"{k}={record[k]}" for k in bad)
    return None


RULES = (
    Rule(
        1,
        "kl_large",
        _kl_large,
        "the policy has moved far from the reference: kl_coef too small, learning rate too high or too many "
        "updates per batch, and it may be over-optimising the reward where the reward model is not trusted.",
        "raise kl_coef (or use adaptive_kl), lower the learning rate, or do fewer PPO epochs / GRPO "
        "iterations per batch.",
    ),
    Rule(
        2,
        "kl_tiny_reward_flat",
        _kl_tiny_reward_flat,
        "the policy barely moves: kl_coef too large, learning rate too low, advantages too small, or a reward "
        "that does not tell good responses from bad ones.",
        "lower kl_coef, raise the learning rate, check the advantages' scale and that the reward separates samples.",
    ),
    Rule(
        3,
        "clipping",
        _clipping,
        "updates too large or stale: learning rate too high, too many epochs per batch, advantages too large, "
        "or old log-probs that do not match the sampled tokens.",
        "lower the learning rate or ppo_epochs/num_iterations, use more minibatches, whiten the advantages, "
        "and check the old log-probs.",
    ),
    Rule(
        4,
        "first_minibatch_ratio",
        _first_ratio,
        "the sampler and the training forward give different log-probs for the same tokens (temperature, "
        "top-p/top-k, dropout, padding or position ids, precision, another engine): a bug, not tuning.",
        "compute training log-probs at the sampling temperature with dropout off and the same masks, or "
        "recompute old log-probs with the training forward; PPO clipping is wrong until this is fixed.",
    ),
    Rule(
        5,
        "critic",
        _critic,
        "the critic does not predict the returns: reward scale, the returns computation, masks or the terminal "
        "position, the value-head initialisation, the critic learning rate or the value-loss coefficient.",
        "check the reward scale (whiten_rewards, reward_clip), masks and where the score lands, start the critic "
        "from the reward model, and tune critic_lr or vf_coef.",
    ),
    Rule(
        6,
        "length_bias",
        _length_bias,
        "the reward prefers longer responses, so the policy learns to be longer rather than better "
        "(length bias, a form of reward hacking).",
        "add a length penalty or length normalisation, raise kl_coef, calibrate the reward model on "
        "length-controlled pairs, and judge quality with an independent evaluation.",
    ),
    Rule(
        7,
        "reward_up_heldout_down",
        _rise_then_collapse,
        "the policy over-optimises the training reward (reward hacking, or drifting out of the region where "
        "the reward model is trustworthy) instead of getting better at the task; a large drop whatever the "
        "reward does: the run is unlearning the task (learning rate too high, too little KL).",
        "keep the best checkpoint and stop earlier, raise kl_coef, lower the learning rate, and prefer "
        "verifiable or ensemble rewards checked by metrics the optimiser never sees.",
    ),
    Rule(
        8,
        "entropy_collapse",
        _entropy_collapse,
        "the policy collapsed onto a few outputs (too little KL, too high a learning rate or too low a "
        "sampling temperature), so exploration has stopped.",
        "raise kl_coef or the sampling temperature, lower the learning rate, or add an entropy bonus "
        "(entropy_coef) or clip-higher (clip_high).",
    ),
    Rule(
        9,
        "zero_variance_groups",
        _zero_variance,
        "most groups score every response the same (all right or all wrong), so their advantages are 0 and "
        "they carry no signal: prompts too easy or too hard for the model, or a reward too coarse.",
        "use dynamic_sampling, more num_generations, prompts of a better-matched difficulty, or a "
        "finer-grained reward.",
    ),
    Rule(
        10,
        "truncation",
        _truncation,
        "many responses hit max_new_tokens without EOS: the budget is too small for the task, the policy "
        "learned to ramble, or EOS is not handled.",
        "raise sampling.max_new_tokens, add missing_eos_penalty or the overlong penalty (or mask_truncated), "
        "and check the EOS ids.",
    ),
    Rule(
        15,
        "length_at_limit",
        _length_at_limit,
        "the reward pays for length and the policy has run into the length limit to collect it: the score "
        "still rises, but from length the limit no longer shows (a length-biased reward model; compare its "
        "`posttrain rm` length probe).",
        "add a length penalty or missing_eos_penalty, raise kl_coef, retrain the reward model on "
        "length-controlled pairs, and judge progress by an evaluation the optimiser never sees.",
    ),
    Rule(
        14,
        "off_policy_gap",
        _off_policy_gap,
        "the samples come from a policy further and further from the one being trained: asynchronous batches "
        "too stale for the learning rate, or a sampler (vLLM) whose kernels or precision drift from the "
        "trainer's; the importance weights then carry the update, the known route to collapse.",
        "lower rollout.async_steps or the learning rate, set rollout.importance_sampling (token_mask or "
        "sequence_mask drop what cannot be corrected), or sample in the training precision.",
    ),
    Rule(
        11,
        "non_finite",
        _non_finite,
        "NaN or inf in the loss, gradient or reward: a near-zero std in constant groups, exp overflow at "
        "padding, fp16 overflow, or a reward function returning inf.",
        "check the reward values and the advantage normalisation, lower the learning rate, train in bf16 or "
        "fp32, and read the step's samples.",
    ),
)


# --------------------------------------------------------------------------------------------------
# every trainer: a dead run (12); SFT: a model collapsed to the uniform distribution (13)
# --------------------------------------------------------------------------------------------------

DEAD_STEPS = 3
"""12: this many updates in a row that had something to learn (``_has_something_to_learn``), each with a
gradient norm at or below ``ZERO_GRAD_NORM``, or all with one loss: the run is dead."""
ZERO_GRAD_NORM = 1e-8
"""12: a gradient norm at or below this is no gradient."""
ZERO_GRAD_LOSS = 1e-3
"""12: a loss (or distillation's KL to its teacher) at or below this in size leaves nothing to learn."""
FLAT_LOSS_TOL = 1e-6
"""12: losses that differ by at most this share of their size (at least 1e-6 nats) have not moved..."""
LOSS_MOVED = 1e-3
"""12: ...once the loss has left its first value by more than this (nats): a run whose loss stays at its start
(DPO's ln 2 while the policy is still its reference, at a small learning rate) is slow, not dead."""
GRAD_NORM_KEYS = {"grad_norm": "the gradient norm", "critic_grad_norm": "the critic's gradient norm"}
"""12: the gradient norms the trainers log (PPO: the policy's and the critic's), each watched on its own."""


def _has_something_to_learn(record: dict) -> bool:
    """Whether a step made an update that had something to learn, so that a zero gradient or a loss that
    does not move means a dead run: it logged a finite gradient norm (a step with nothing to train, such
    as an online step with no scored pair or token, logs none); not every GRPO group was constant (all
    advantages 0: a zero gradient by construction); and neither its ``loss`` nor distillation's KL to the
    teacher is ~0 (a fitted model, a student equal to its teacher: nothing left to learn). GRPO's, PPO's and
    distillation's ``policy/loss`` is a surrogate that is ~0 by construction: rule 12 never reads it."""
    if all(_finite(record.get(key)) is None for key in GRAD_NORM_KEYS):
        return False
    if record.get("groups/zero_variance_share") == 1:
        return False
    sizes = [_finite(record.get(key)) for key in ("loss", "distill/reverse_kl")]
    return all(abs(v) > ZERO_GRAD_LOSS for v in sizes if v is not None)


def _dead_run(h: History, cfg, ctx):
    updates = list(h.updates)
    if len(updates) < DEAD_STEPS:
        return None
    losses = [_finite(u.get("loss")) for u in updates]
    at = f" while the loss is {losses[-1]:.4g}" if losses[-1] is not None else ""
    for key, what in GRAD_NORM_KEYS.items():
        norms = [_finite(u.get(key)) for u in updates]
        if all(n is not None and n <= ZERO_GRAD_NORM for n in norms):
            return f"{what} has been {norms[-1]:.3g} for {DEAD_STEPS} updates in a row{at}: the updates move nothing"
    flat = None not in losses and max(losses) - min(losses) <= FLAT_LOSS_TOL * max(1.0, abs(losses[-1]))
    if flat and h.loss_moved:
        return f"the loss has stayed at {losses[-1]:.6g} for {DEAD_STEPS} updates in a row: the model no longer changes"
    return None


UNIFORM_STEPS = 3
"""13: this many logged losses in a row at ln V, not moving: the model predicts the uniform distribution."""
UNIFORM_TOL = 1e-3
"""13: |loss − ln V| at most this (nats), and the losses within this of each other."""


def _uniform_output(h: History, cfg, ctx):
    log_vocab = ctx.get("log_vocab")
    losses = h.tail("loss")[-UNIFORM_STEPS:]
    if log_vocab is None or len(losses) < UNIFORM_STEPS:
        return None
    if max(abs(v - log_vocab) for v in losses) > UNIFORM_TOL or max(losses) - min(losses) > UNIFORM_TOL:
        return None
    return (
        f"the loss has stayed at {losses[-1]:.4f} = ln V (V = {round(math.exp(log_vocab))} tokens) for "
        f"{UNIFORM_STEPS} steps: the model predicts every token with probability 1/V"
    )


DEAD_RUN_RULES = (
    Rule(
        12,
        "zero_gradient",
        _dead_run,
        "the model collapsed (a learning rate far too high saturated it: every logit equal, or activations "
        "dead), or nothing in the batch is trained (every label masked, every parameter frozen); a loss that "
        "does not move at all: the weights no longer change.",
        "lower optim.lr (and keep optim.max_grad_norm), restart from the last checkpoint before the collapse, and "
        "check that the completions are not all cut or masked and that some parameters train.",
    ),
)
"""Every trainer's: run after each step by the online trainers (beside ``RULES``) and the offline ones."""

SFT_RULES = (
    *DEAD_RUN_RULES,
    Rule(
        13,
        "uniform_output",
        _uniform_output,
        "the model collapsed to the uniform distribution (loss = ln V): a learning rate far too high, or a "
        "diverged update that the non-finite guard could not see.",
        "lower optim.lr, add warm-up (optim.warmup_steps) and gradient clipping, and restart from the last good "
        "checkpoint; this model's final/ has learned nothing.",
    ),
)


# --------------------------------------------------------------------------------------------------
# a reward model: its length probe at the end of `posttrain rm` (and in `posttrain eval`)
# --------------------------------------------------------------------------------------------------

LENGTH_PREFERRED_MAX = 0.5
"""16: a reward model that scores the same answer said twice above it said once in more than this share of the
length probe's pairs (``trainers.rm.length_probe``) pays for length: more often than not."""


def describe_length_probe(metrics: dict) -> str:
    """The length probe's ``metrics`` (keys with or without ``eval/``) in words."""
    values = {k.removeprefix("eval/"): v for k, v in metrics.items()}
    return (
        f"the same answer said twice scored above it said once in {values['length_probe/longer_preferred']:.0%} of "
        f"{values['length_probe/pairs']:.0f} pairs ({values['length_probe/score_per_token']:+.3g} per extra token)"
    )


def length_preference(metrics: dict) -> str | None:
    """What rule 16 sees in the length probe's ``metrics``, or None (no probe, or no preference for length)."""
    share = _finite({k.removeprefix("eval/"): v for k, v in metrics.items()}.get("length_probe/longer_preferred"))
    if share is None or share <= LENGTH_PREFERRED_MAX:
        return None
    return f"the reward model pays for length: {describe_length_probe(metrics)}"


def _rm_prefers_length(h: History, cfg, ctx):
    return length_preference(h.last)


RM_RULES = (
    Rule(
        16,
        "rm_prefers_length",
        _rm_prefers_length,
        "the reward model learned that longer is better (human labels favour longer answers, or the chosen "
        "answers of the data are longer): PPO or GRPO against it will grow responses to the length limit.",
        "balance the lengths of chosen and rejected answers (or add length-controlled pairs: the same content, "
        "longer, as the rejected one), train with a margin or centering, and use a length penalty in RL.",
    ),
)
"""What ``posttrain rm`` checks once, after its length probe."""


class HealthMonitor:
    """Runs the rules after every logged step; ``check`` returns the alerts raised at that step.

    reward / reward_std: the keys of the training reward and its batch std (GRPO ``reward/*``; PPO
    ``score/*``, since PPO's ``reward/mean`` includes the KL penalty). forced_length: every response
    is cut at max_new_tokens by design (min_new_tokens = max_new_tokens), so truncation is no signal.
    rules: the rules to run (``RULES``; the online trainers add ``DEAD_RUN_RULES``, the offline ones run those
    alone, SFT ``SFT_RULES``); context: what else they read (SFT: log_vocab).
    """

    def __init__(
        self,
        config: AlertConfig,
        output_dir: str | Path | None,
        reward: str,
        reward_std: str,
        forced_length: bool = False,
        echo: Callable[[str], None] = print,
        rules: tuple[Rule, ...] = RULES,
        context: dict | None = None,
    ):
        self.config = config
        self.path = None if output_dir is None else Path(output_dir) / "alerts.jsonl"
        self.context = {"reward": reward, "reward_std": reward_std, "forced_length": forced_length, **(context or {})}
        self.echo = echo
        self.rules = rules
        self.history = History(config.window, reward, reward_std)
        self.active: set[int] = set()
        self.raised = 0

    def check(self, step: int, metrics: dict) -> list[dict]:
        """Add this step's metrics to the history; return (and record) the alerts that start now."""
        if not self.config.enabled:
            return []
        self.history.add({"step": step, **metrics})
        alerts = []
        for rule in self.rules:
            seen = rule.check(self.history, self.config, self.context)
            if seen is None:
                self.active.discard(rule.id)
                continue
            if rule.id in self.active:
                continue
            self.active.add(rule.id)
            alerts.append(
                {"step": step, "id": rule.id, "name": rule.name, "seen": seen, "causes": rule.causes}
                | {"remedy": rule.remedy}
            )
        self.raised += len(alerts)
        for alert in alerts:
            self.echo(format_alert(alert))
        if alerts and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(a) + "\n" for a in alerts)
        return alerts

    def restore(self, records: list[dict], raised: int) -> None:
        """The state of a resumed run: its logged records (``metrics.jsonl`` up to the checkpoint) replayed
        silently into the history, so trend rules continue instead of waiting a window again and an
        alert that was active stays active (not raised twice); ``raised``: alerts it recorded so far.
        With ``run.log_every`` > 1 the history holds the logged steps only."""
        path, echo = self.path, self.echo
        self.path, self.echo = None, lambda _: None
        try:
            for record in records:
                self.check(record["step"], {k: v for k, v in record.items() if k not in ("step", "time")})
        finally:
            self.path, self.echo = path, echo
        self.raised = raised


def format_alert(alert: dict) -> str:
    return (
        f"[alert {alert['id']} {alert['name']}] step {alert['step']}: {alert['seen']}\n"
        f"    likely causes: {alert['causes']}\n    try: {alert['remedy']}"
    )


def read_alerts(output_dir: str | Path) -> list[dict]:
    """The alerts a run recorded (empty when none)."""
    path = Path(output_dir) / "alerts.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

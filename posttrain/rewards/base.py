"""The reward-function interface.

A reward function is any Python callable

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

where ``columns`` are the other columns of the prompt rows (``answer``, ``tests``, ...), one value per
completion. ``None`` means "not applicable to this sample" (a math reward on a coding prompt): it is
left out of the weighted sum, never counted as 0. Any other value must be a real number (int, float,
bool as 0/1, a numpy scalar) and finite; anything else stops the run naming the function and sample.
In YAML a reward is named ``module:function`` or ``path/to/file.py:function`` with a weight.

A function that names a parameter ``prompt_ids`` / ``completion_ids`` also gets the rollout's token
ids (one list per sample: the templated prompt without padding; the completion up to and including
its EOS), and one that names ``policy_tokenizer`` gets the policy's tokenizer: what a reward model
needs to read exactly the tokens the policy produced (``posttrain.rewards.model``).

A function may also keep counts of its own (a judge's verdicts that did not parse): one that names a
parameter ``reward_counts`` gets a ``collections.Counter`` that its ``RewardComposer`` keeps for that spec
alone, and each entry it adds to is logged, cumulative, as ``reward/<function>/<name>`` next to its
failures and timeouts (``posttrain.rewards.judge``). Like those, the counts are the composer's, in its
process: a run's training and evaluation rewards count apart, and under data parallelism the logged
value is the main process's (not summed over processes). Such a function runs inline (a forked worker's
counts are lost with it).

And a function may check its settings before any model loads: a ``validate_kwargs(kwargs, where)``
attribute, called by ``RewardSpec.validate`` with ``where`` = ``rewards[i].kwargs``, raises ValueError
naming ``<where>.<key>``; a ``required_columns(kwargs)`` attribute lists data columns it needs besides
its parameters (a judge's template placeholders), checked with those (``required_columns``).
"""

from __future__ import annotations

import collections
import difflib
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import os
import queue
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from posttrain.errors import UserError
from posttrain.rewards import sandbox

RewardFunction = Callable[..., list]
ON_ERROR = ("raise", "skip")
ISOLATION = ("process", "inline")
# Our reward models and judges as reward functions run inline, never in a forked worker. They are our own
# code and hold a torch model: inline, it is loaded once and kept, on any device, and scores on every thread. A
# forked worker loads it again in every call, cannot use CUDA once the trainer has, and inherits torch's
# OpenMP and MKL state without the threads behind it, which can hang it (see _child and _InlineThread).
MODEL_FUNCTIONS = (
    "posttrain.rewards.model:reward_model",
    "posttrain.rewards.model:reward_ensemble",
    "posttrain.rewards.judge:judge_score",
    "posttrain.rewards.judge:judge_yes_probability",
)
# max_failure_rate is judged on at least this many samples: before 20 are scored, the run stops once the
# failures exceed the share of 20 (0.1: a third failure), so 14 failures in 16 samples stop it and one in 8 does not
_MIN_SAMPLES_FOR_ABORT = 20
TOKEN_COLUMNS = ("prompt_ids", "completion_ids")  # handed only to functions that name them
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardError(RuntimeError):
    """A reward function failed in a way the run must not continue past. Raised as such when the function
    itself raised: a bug in its code, whose traceback the message carries."""


class RewardValueError(RewardError, UserError):
    """A reward function (or the environment, through ``environment_reward``) returned what is no reward: not
    a list of one value per completion, a value that is not a real number, NaN, inf, or a weighted sum beyond
    float32; or it failed or scored nothing too often. One line naming the function: the CLI prints it so."""


@dataclass
class RewardSpec:
    """One reward function of a weighted sum."""

    function: str = ""
    """``module:function`` or ``path/to/file.py:function``; from Python also the function itself, recorded by
    the name that imports it (``__main__:correct_sum`` for one defined in the script)."""
    weight: float = 1.0
    """Weight in the sum of rewards."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments bound to the function (e.g. a soft length limit)."""
    timeout: float = 60.0
    """Seconds one call may take; a call that hangs is killed and its samples get None (counted)."""
    on_error: str = "raise"
    """A call that raises: raise (stop, showing the traceback and the offending prompt and completion)
    or skip (that sample gets None and is counted)."""
    max_failure_rate: float = 0.1
    """Stop the run when more than this share of the samples scored so far failed or timed out; before 20
    samples, more than this share of 20 (0.1: a third failure stops it)."""
    isolation: str | None = None
    """process: each call runs in a forked worker that is killed on timeout (torch in it runs on one
    thread); inline: in a thread of this process (a hung call is abandoned, not killed). null: inline for
    the reward models of posttrain.rewards.model and the judges of posttrain.rewards.judge (which refuse
    process), process for every other function."""
    retry_after_timeout: bool = False
    """After a batch call times out, score its samples one by one, all within one more ``timeout``, to
    keep the samples that do not hang (process isolation only). Off: every sample of the call gets None."""

    def __post_init__(self) -> None:
        if callable(self.function):  # the function itself, as TRL takes it: config.yaml records its name
            self.function = function_name(self.function)

    def validate(self, name: str = "rewards[]") -> None:
        if ":" not in self.function:
            raise ValueError(
                f"{name}.function must look like module:function or path/file.py:function, got {self.function!r}"
            )
        if self.on_error not in ON_ERROR:
            raise ValueError(f"{name}.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.isolation is not None and self.isolation not in ISOLATION:
            raise ValueError(f"{name}.isolation must be one of {ISOLATION} or null, got {self.isolation!r}")
        if not 0 < self.timeout < math.inf or not 0 <= self.max_failure_rate <= 1:
            raise ValueError(f"{name}: timeout must be finite and > 0, and max_failure_rate in [0, 1]")
        if self.retry_after_timeout and self.effective_isolation != "process":
            raise ValueError(
                f"{name}.retry_after_timeout needs {name}.isolation: process (a hung thread cannot be killed)"
            )
        if self.isolation == "process" and self.function in MODEL_FUNCTIONS:
            raise ValueError(
                f"{name}.isolation: process cannot run {self.function}: a worker forked from the trainer can "
                f"hang in torch (OpenMP and MKL state copied without its threads), would load the model again "
                f"in every call and cannot use CUDA; leave {name}.isolation unset (inline, its default)"
            )
        if self.effective_isolation == "process" and str(self.kwargs.get("device", "cpu")).startswith("cuda"):
            raise ValueError(  # torch refuses to initialise CUDA again in a child forked after the trainer did
                f"{name}.isolation: process runs {self.function} in a forked worker, which cannot use CUDA "
                f"(kwargs.device={self.kwargs['device']}); set {name}.isolation: inline"
            )
        self._validate_kwargs(name)

    def _validate_kwargs(self, name: str) -> None:
        """The function's own check of ``kwargs`` (``fn.validate_kwargs``, module docstring), when it has one.
        A function that does not import is left to ``runtime.inputs.check_reward_functions``, which says why."""
        try:
            fn = load_reward_function(self.function)
        except Exception:
            return
        check = getattr(fn, "validate_kwargs", None)
        if check is not None:
            check(self.kwargs, f"{name}.kwargs")

    @property
    def effective_isolation(self) -> str:
        """``isolation``, or its default for this function when unset."""
        return self.isolation or ("inline" if self.function in MODEL_FUNCTIONS else "process")

    @property
    def name(self) -> str:
        return self.function.rsplit(":", 1)[1]


def function_name(fn: Callable) -> str:
    """``module:function`` that imports ``fn`` again: what config.yaml records, and what a resumed run and
    every process load. ValueError for a function no name imports (a lambda, a nested function, a partial)."""
    spec = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    try:
        same = load_reward_function(spec) is fn
    except (ImportError, ValueError):
        same = False
    if not same:
        raise ValueError(
            f"rewards: {fn!r} cannot be imported by its name {spec!r}, which the run records in config.yaml and "
            "loads again on resume: define it with def at the top level of a module or of the script, or pass "
            "'module:function' / 'path/file.py:function'"
        )
    return spec


def load_reward_function(spec: str, kind: str = "function", label: str = "reward function") -> RewardFunction:
    """Import ``module:function`` or ``path/to/file.py:function``. ``kind="class"`` imports a class (an
    environment); ``label`` names what is loaded in the messages."""
    target, _, attribute = spec.rpartition(":")
    if not target or not attribute:
        raise ValueError(f"a {label} is named module:{kind} or path/file.py:{kind}, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"{label} file not found: {path}")
        module_spec = importlib.util.spec_from_file_location(f"posttrain_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, attribute, None)
    if not callable(fn):
        defines = inspect.isclass if kind == "class" else inspect.isfunction
        defined = sorted(name for name, value in vars(module).items() if defines(value) and not name.startswith("_"))
        close = difflib.get_close_matches(attribute, defined, n=1)
        guess = f"did you mean {close[0]}? " if close else ""
        plural = "classes" if kind == "class" else "functions"
        raise ValueError(
            f"{spec}: {target} has no {kind} {attribute!r} ({guess}its {plural}: {', '.join(defined) or 'none'})"
        )
    return fn


def required_columns(fn: RewardFunction, bound: dict | None = None) -> list[str]:
    """The data columns ``fn`` cannot be called without: its parameters after (prompts, completions)
    that have no default, are not bound by the spec's ``kwargs``, and are not handed over by posttrain
    (``prompt_ids``, ``completion_ids``, ``policy_tokenizer``, ``reward_counts``), then the columns its
    ``required_columns`` attribute names (module docstring). ``**columns`` takes whatever there is."""
    handed = {*TOKEN_COLUMNS, "policy_tokenizer", "reward_counts", *(bound or {})}
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    skipped = {p.name for p in positional[:2]}  # prompts, completions
    needed = [
        p.name
        for p in params
        if p.name not in skipped
        and p.name not in handed
        and p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    named = getattr(fn, "required_columns", None)
    return needed + [c for c in (named(bound or {}) if named else []) if c not in needed]


def reward_columns(specs: list[RewardSpec]) -> dict[str, list[str]]:
    """{reward function name: the data columns it needs} of ``specs`` (``required_columns``)."""
    return {spec.name: required_columns(load_reward_function(spec.function), spec.kwargs) for spec in specs}


@dataclass
class RewardOutput:
    """Rewards of B completions."""

    total: torch.Tensor  # [B] Σ_i w_i·r_i over the applicable functions; NaN where none applies
    components: dict[str, list[float | None]]  # per function, as it returned them
    faults: dict[str, float] = field(default_factory=dict)  # cumulative failures and timeouts per function

    @property
    def applicable(self) -> torch.Tensor:
        """[B] bool: at least one function scored the sample."""
        return ~torch.isnan(self.total)

    def metrics(self) -> dict[str, float]:
        out = {"reward/applicable_share": float(self.applicable.float().mean()) if len(self.total) else math.nan}
        for name, values in self.components.items():
            scored = [v for v in values if v is not None]
            out[f"reward/{name}/mean"] = sum(scored) / len(scored) if scored else math.nan
            out[f"reward/{name}/applicable"] = len(scored) / max(len(values), 1)
        out.update(self.faults)
        return out


def unpad(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """[B, L] padded ids and their mask → B lists of the unmasked ids (the ``prompt_ids`` /
    ``completion_ids`` columns handed to reward functions)."""
    return [row[keep.bool()].tolist() for row, keep in zip(ids.cpu(), mask.cpu(), strict=True)]


def score_rollout(rewards, rollout, columns: dict):
    """``rewards(...)`` (a ``RewardComposer``) on a rollout, with the arguments training and evaluation both
    give: the decoded texts, the rows' columns, and the prompt and completion ids as sampled (a reward model
    reads those tokens, EOS included, not the text re-tokenised)."""
    return rewards(
        rollout.prompts,
        rollout.responses,
        columns,
        unpad(rollout.prompt_ids, rollout.prompt_mask),
        unpad(rollout.response_ids, rollout.response_mask),
    )


def _returned(result) -> tuple[str, object]:
    """("ok", list) of what a reward function returned, or ("bad", what it was instead)."""
    if isinstance(result, list | tuple):
        return "ok", list(result)
    if isinstance(result, torch.Tensor | np.ndarray) and result.ndim == 1:
        return "ok", result.tolist()
    if result is None:
        return "bad", "None instead of a list"
    return "bad", f"a {type(result).__name__} ({repr(result)[:200]})"


def _die_with_parent(parent: int) -> None:
    """End the worker when the trainer dies, as the sandbox's programs do: on Linux the parent-death
    signal (SIGKILL when the thread that forked it ends; that thread waits for the worker), elsewhere a
    thread that checks every 0.2 s whether the parent changed; and at once if it already has."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.2)
            os._exit(1)

        threading.Thread(target=watch, name="posttrain-reward-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the trainer died before the signal was set
        os._exit(1)


def _child(conn, fn, prompts, completions, columns, parent: int) -> None:
    _die_with_parent(parent)
    os.setsid()  # a group of its own: a timeout kills the worker and everything it started
    # Torch on one thread, before any torch op. The trainer has run parallel ops, so its OpenMP runtime
    # (libgomp, not fork-safe) believes its worker threads exist; fork copies only this thread, and the
    # child's first parallel op (a matmul, a model load) waits at a barrier for them until the timeout
    # (pytorch issues 17199, 21956). One thread never starts a team; DataLoader workers do the same.
    torch.set_num_threads(1)
    try:
        conn.send(_returned(fn(prompts, completions, **columns)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def call_with_timeout(fn, prompts, completions, columns, timeout: float, isolation: str = "process"):
    """("ok", values) | ("bad", what was returned) | ("error", traceback) | ("timeout", None) of one call."""
    if isolation == "inline":
        global _inline_thread
        if _inline_thread is None:
            _inline_thread = _InlineThread()
        answer = _inline_thread.run(partial(_inline, fn, prompts, completions, columns), timeout)
        if answer is None:
            _inline_thread = None  # it stays in the hung call: the next inline call gets a new thread
            return ("timeout", None)
        return answer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a forked child must not use tokenizer threads
    sandbox.lease()  # before the fork: the worker's sandboxes use this process's user ids, reaped below
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_child, args=(sender, fn, prompts, completions, columns, os.getpid()), daemon=True)
    worker.start()
    sender.close()
    answered = False
    try:
        if receiver.poll(timeout):
            answer = receiver.recv()
            answered = True
            return answer
        return ("timeout", None)
    except EOFError:  # the worker died without answering (killed, out of memory)
        worker.join(1.0)
        return ("error", f"the reward worker exited with status {worker.exitcode} without an answer")
    finally:
        if worker.is_alive():  # hung, or lingering after its answer: its group (it and whatever it started)
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except OSError:  # it ended between the check and the kill, or before its setsid
                worker.kill()
        worker.join()
        if not answered:  # the sandbox programs and folders a dead worker may have left
            sandbox.reap()
        receiver.close()


class _InlineThread:
    """The thread that runs the inline calls one after another, for the life of the process (a new one
    only after a call overran its timeout and was left in it).

    Not a thread per call: when a thread that ran torch ops ends, MKL releases its buffers and those of
    its OpenMP worker, and a worker forked in that moment for the next reward function (isolation:
    process) can inherit MKL's allocator mid-update and spin in ``mkl_serv_allocate`` forever: a thread
    per call hung that way within a few calls, this one thread never (docs/reliability.md)."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="posttrain-inline-rewards", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, answer, done = self.calls.get()
            answer.append(call())
            done.set()

    def run(self, call, timeout: float):
        """``call()``'s result, or None when it has not returned within ``timeout`` seconds."""
        answer, done = [], threading.Event()
        self.calls.put((call, answer, done))
        return answer[0] if done.wait(timeout) else None


_inline_thread: _InlineThread | None = None


def _inline(fn, prompts, completions, columns):
    try:
        return _returned(fn(prompts, completions, **columns))
    except BaseException:
        return ("error", traceback.format_exc())


@dataclass
class _Tracked:
    name: str
    fn: RewardFunction
    weight: float
    spec: RewardSpec
    token_columns: list[str]  # the TOKEN_COLUMNS it names
    samples: int = 0
    failures: int = 0
    timeouts: int = 0  # samples left without a score by a timeout
    batch_timeouts: int = 0  # calls that timed out
    counts: collections.Counter = field(default_factory=collections.Counter)  # its own (module docstring)


class RewardComposer:
    """A weighted sum of reward functions, each run under a timeout and each component kept for logging.

    ``max_unscored_steps``: stop after this many calls in a row in which no function scored any
    sample (every value None: nothing is learned from such a batch), warning before; 0 only warns,
    None checks nothing (another reward, a reward model, scores every sample). ``warn``: where that
    warning goes (a trainer prints it on its console; default a ``RuntimeWarning``)."""

    def __init__(
        self,
        functions: list[tuple[str, RewardFunction, float]],
        specs: list[RewardSpec] | None = None,
        tokenizer=None,
        max_unscored_steps: int | None = 3,
        warn: Callable[[str], None] | None = None,
    ):
        if not functions:
            raise ValueError("at least one reward function is needed")
        specs = specs or [
            RewardSpec(function=f"<callable>:{name}", weight=w, isolation="inline") for name, _, w in functions
        ]
        self.functions = []
        for (name, fn, w), spec in zip(functions, specs, strict=True):
            wanted = set(inspect.signature(fn).parameters)
            if "policy_tokenizer" in wanted:
                fn = partial(fn, policy_tokenizer=tokenizer)
            counts = collections.Counter()  # this composer's, for this spec alone
            if "reward_counts" in wanted:
                fn = partial(fn, reward_counts=counts)
            tracked = _Tracked(name, fn, w, spec, [c for c in TOKEN_COLUMNS if c in wanted], counts=counts)
            self.functions.append(tracked)
        self.max_unscored_steps = max_unscored_steps
        self.unscored_steps = 0
        self.warn = warn

    @classmethod
    def from_specs(
        cls,
        specs: list[RewardSpec],
        tokenizer=None,
        max_unscored_steps: int | None = 3,
        warn: Callable[[str], None] | None = None,
    ) -> RewardComposer:
        functions = []
        for spec in specs:
            fn = load_reward_function(spec.function)
            functions.append((spec.name, partial(fn, **spec.kwargs) if spec.kwargs else fn, spec.weight))
        return cls(functions, specs, tokenizer, max_unscored_steps, warn)

    def _scores(self, tracked: _Tracked, prompts, completions, columns) -> list:
        """One function's values; on a timeout or an error, handled as its spec says."""
        spec, B = tracked.spec, len(completions)
        status, payload = call_with_timeout(
            tracked.fn, prompts, completions, columns, spec.timeout, spec.effective_isolation
        )
        if status == "bad":
            raise RewardValueError(
                f"reward function {tracked.name!r} returned {payload}; it must return a list of {B} values, one per "
                "completion: a float, or None for a completion it does not score (None is allowed per sample, inside "
                "the list, not in place of the list)"
            )
        if status == "ok":
            values = payload
            if len(values) != B:
                raise RewardValueError(
                    f"reward function {tracked.name!r} returned {len(values)} values for {B} completions"
                )
        elif status == "timeout" and not spec.retry_after_timeout:  # one deadline per call: no B more waits
            values = [None] * B
            tracked.batch_timeouts += 1
            tracked.timeouts += B
        else:
            tracked.batch_timeouts += status == "timeout"
            values = self._one_by_one(tracked, prompts, completions, columns)
        tracked.samples += B
        bad = tracked.failures + tracked.timeouts
        if bad > spec.max_failure_rate * max(tracked.samples, _MIN_SAMPLES_FOR_ABORT):
            raise RewardValueError(
                f"reward function {tracked.name!r}: {tracked.failures} failures and {tracked.timeouts} timeouts "
                f"({tracked.batch_timeouts} timed-out calls) in {tracked.samples} samples, over "
                f"max_failure_rate={spec.max_failure_rate}"
            )
        return values

    def _one_by_one(self, tracked: _Tracked, prompts, completions, columns) -> list:
        """Find the samples that fail or hang, one call each, all within one ``timeout`` together."""
        spec, values = tracked.spec, []
        deadline = time.monotonic() + spec.timeout
        for b in range(len(completions)):
            left = deadline - time.monotonic()
            if left <= 0:
                tracked.timeouts += 1
                values.append(None)
                continue
            one = {k: [v[b]] for k, v in columns.items()}
            status, payload = call_with_timeout(
                tracked.fn, [prompts[b]], [completions[b]], one, left, spec.effective_isolation
            )
            if status == "ok" and len(payload) == 1:
                values.append(payload[0])
                continue
            if status == "timeout":
                tracked.timeouts += 1
            elif spec.on_error == "raise":
                raise RewardError(
                    f"reward function {tracked.name!r} raised on a sample (set on_error: skip to score it "
                    f"None and go on)\nprompt: {prompts[b]!r}\ncompletion: {completions[b]!r}\n{payload}"
                )
            else:
                tracked.failures += 1
            values.append(None)
        return values

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        prompt_ids: list[list[int]] | None = None,
        completion_ids: list[list[int]] | None = None,
    ) -> RewardOutput:
        """Score B samples. ``prompt_ids`` / ``completion_ids``: the rollout's tokens (``unpad``), handed
        to the functions that name them."""
        B = len(completions)
        token_ids = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
        total = torch.zeros(B, dtype=torch.float64)  # float64: a large sum is checked, not overflowed
        scored = torch.zeros(B, dtype=torch.bool)
        components = {}
        for tracked in self.functions:
            given = {c: token_ids[c] for c in tracked.token_columns if token_ids[c] is not None}
            values = self._scores(tracked, prompts, completions, {**columns, **given})
            for b, value in enumerate(values):
                if value is not None:
                    total[b] += tracked.weight * _checked(tracked.name, value, prompts[b], completions[b])
                    scored[b] = True
            components[tracked.name] = values
        for b in (~total.abs().le(_FLOAT32_MAX) & scored).nonzero().flatten().tolist():
            parts = {name: values[b] for name, values in components.items() if values[b] is not None}
            raise RewardValueError(
                f"the weighted sum of rewards of completion {b} is {float(total[b]):g}, beyond float32 (±3.4e38): "
                f"{parts} (prompt {prompts[b]!r}, completion {completions[b]!r})"
            )
        self._count_unscored(int(scored.sum()), B)
        total = torch.where(scored, total, torch.nan).float()
        return RewardOutput(total, components, self.fault_counts())

    def _count_unscored(self, scored: int, B: int) -> None:
        if self.max_unscored_steps is None:
            return
        if scored or not B:
            self.unscored_steps = 0
            return
        self.unscored_steps += 1
        names = ", ".join(t.name for t in self.functions)
        if self.max_unscored_steps and self.unscored_steps >= self.max_unscored_steps:
            raise RewardValueError(
                f"no reward function ({names}) scored any sample in {self.unscored_steps} steps in a row (every "
                f"value None): nothing is being learned. Check that the data has the columns they need."
            )
        message = (
            f"no reward function ({names}) scored any of the {B} samples (every value None): nothing is learned "
            f"from this batch ({self.unscored_steps} in a row; the run stops at max_unscored_steps="
            f"{self.max_unscored_steps})"
        )
        if self.warn is not None:
            self.warn(message)
        else:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def fault_counts(self) -> dict[str, float]:
        """Each function's failures, timeouts and own counts (``reward_counts``) so far: this composer's, in
        this process (the trainers log them as they are, not summed over processes)."""
        out = {}
        for t in self.functions:
            out[f"reward/{t.name}/failures"] = t.failures
            out[f"reward/{t.name}/timeouts"] = t.timeouts
            out[f"reward/{t.name}/batch_timeouts"] = t.batch_timeouts
            out.update({f"reward/{t.name}/{key}": float(value) for key, value in t.counts.items()})
        return out


def _checked(name: str, value, prompt: str, completion: str) -> float:
    """``value`` as a float when it is a finite real number (bool counts as 0/1); else a RewardError."""
    where = f"for prompt {prompt!r}, completion {completion!r}"
    who = f"reward function {name!r}"
    if name == "environment_reward":  # the episode's reward: what the environment's step() returned, summed
        who = "the environment (env.name: its step() rewards make the episode's environment_reward)"
    if not isinstance(value, numbers.Real):
        raise RewardValueError(
            f"{who} returned {type(value).__name__} {repr(value)[:200]} {where}; "
            f"each value must be a real number (int, float) or None for 'not applicable'"
        )
    value = float(value)
    if math.isnan(value):
        raise RewardValueError(f"{who} returned NaN {where}; return None for 'not applicable'")
    if math.isinf(value):
        raise RewardValueError(f"{who} returned {value} {where}; rewards must be finite")
    return value

"""What the online trainers (PPO, GRPO) share, written once: the loop around a step (``OnlineTrainer``:
prompts and their order, the rollout engine, the end of a step, checkpoints and resume), shuffled
minibatches (``minibatches``; their micro-batches, backward shares, optimizer steps and the step's statistics
are ``runtime.update``'s), reference and old log-probs, global statistics across processes, phase timers and
metrics.

The algorithms themselves (what is computed from a rollout and in which order, and the update's forward →
loss → backward → step) stay in ``PPOTrainer`` and ``GRPOTrainer``, where they read like the papers'
algorithm boxes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from posttrain.core import masked_importance_weights, masked_whiten, truncated_importance_weights
from posttrain.data import PromptExample, check_columns, load_prompts, rendered
from posttrain.envs import ENDS, UNSCORED, EnvConfig, Environment, data_specs, environment_for, run_episodes
from posttrain.envs.episodes import check_fits, first_messages, prompt_ids
from posttrain.errors import UserError
from posttrain.models import (
    Reference,
    is_peft_model,
    load_tokenizer,
    prompt_cached_logprobs,
    response_logprobs,
    shared_prefix_logprobs,
)
from posttrain.models.template_mode import check_stage
from posttrain.monitor import RunMonitor
from posttrain.rewards import reward_columns
from posttrain.rollout import (
    Rollout,
    RolloutConfig,
    RolloutEngine,
    build_engine,
    choose_engine,
    ignored_checkpoint_sampling,
)
from posttrain.runtime import engines, signals
from posttrain.runtime.checkpoint import save_checkpoint
from posttrain.runtime.inputs import VLLM_LORA_FSDP, check_batch_split, check_inputs, model_context
from posttrain.runtime.loop import (
    PhaseTimer,
    build_accelerator,
    checkpoint_due,
    save_final,
    split_train_eval,
    start_run,
)
from posttrain.runtime.prefix import SharedPrefix, packed_rollout_rows, prompt_cache_applies, unpack_rows
from posttrain.runtime.producer import Producer
from posttrain.runtime.sampling import sample
from posttrain.runtime.update import StepMetrics, Tally, micro_slices, ratio, reduce_tallies


class OnlineTrainer:
    """The loop of an online trainer around its algorithm.

    A subclass sets ``name``, ``BAR_KEYS`` (progress-bar metrics) and ``SCORE_KEYS`` (the reward's mean
    and std metrics, watched by the monitor), loads its models between ``__init__`` and
    ``start_engine``, and writes ``train_step``: the algorithm's numbered steps for one rollout batch.
    ``train`` runs the steps and ``end_step`` after each. The run's state (prompt cursor, and what
    ``state``/``load_state`` add) is saved in every checkpoint and restored on resume.
    """

    name = "online"
    BAR_KEYS: tuple[str, ...] = ()
    SCORE_KEYS: tuple[str, str] = ("reward/mean", "reward/std")

    def console_warning(self, message: str) -> None:
        """A warning line on the main process's console, above the progress bar."""
        if self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            tqdm.write(f"[{self.name}] warning: {message}")

    def __init__(self, config):
        config.validate()
        check_inputs(config)
        self.config = config
        acc = self.accelerator = build_accelerator(config.run)
        torch.manual_seed(config.run.seed)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
        check_stage(acc, config, self.tokenizer, self.name)  # a checkpoint trained with another template mode
        prompts, report = load_prompts(config.data, self.tokenizer)
        specs = config.rewards + ([] if config.eval.path else config.eval.rewards)  # eval.path: the evaluator checks
        check_columns(prompts, reward_columns(data_specs(specs)), config.data.path)  # every column, before any model
        self.prompts, self.eval_prompts = split_train_eval(prompts, config.data.eval_fraction, config.run.seed)
        acc.print(f"[{self.name}] prompts: {report.summary()}")
        if not getattr(getattr(config, "env", None), "enabled", False):  # episodes: printed by start_environment
            acc.print(f"[{self.name}] the first prompt as the model reads it: {rendered(self.tokenizer, prompts[0])}")
        check_batch_split(config, acc.num_processes)
        prompts_per_step = config.run.batch_size // config.num_generations
        self.local_prompts = prompts_per_step // acc.num_processes
        self.total_steps = config.run.max_steps or max(
            1, math.ceil(config.run.epochs * len(self.prompts) / prompts_per_step)
        )
        self.sampler = PromptSampler(len(self.prompts), config.run.seed)
        self.context = model_context(config.model.path) if getattr(config, "env", None) is not None else None
        self.env = start_environment(config, self.tokenizer, self.prompts[0], self.context, acc.print, self.name)
        # the training engine's batch sizes: micro-batches of a minibatch's rows on this process
        rows = self.local_prompts * config.num_generations // config.minibatches
        micro = min(config.run.micro_batch_size, rows)
        engines.configure(acc, micro, math.ceil(rows / micro), config.optim.max_grad_norm)
        acc.print(f"[{self.name}] training engine: {engines.describe(acc)}")
        self.shared = SharedPrefix(enabled=False)  # a trainer with ``shared_prefix`` resolves it once its models load
        self.producer = None  # the asynchronous producer, started by ``train`` (``start_producer``)
        self.step_metrics = StepMetrics()  # the step's logged sums, reduced together when it ends

    def start_engine(self, policy) -> None:
        """The rollout engine sampling from ``policy`` (the unwrapped trained module) and the monitor."""
        if self.config.rollout.engine == "vllm" and engines.is_fsdp(self.accelerator) and is_peft_model(policy):
            raise UserError(VLLM_LORA_FSDP)  # checked at start from the launch; here from the engine in force
        self.policy = policy
        self.accelerator.print(f"[{self.name}] rollout: {self.config.rollout.describe()}")
        if self.config.rollout.engine == "auto":
            chosen, why = choose_engine(policy)
            self.accelerator.print(f"[{self.name}] rollout.engine=auto: {chosen} ({why})")
        ignored = ignored_checkpoint_sampling(policy)
        if ignored:
            settings = ", ".join(f"{k}={v}" for k, v in ignored.items())
            self.accelerator.print(
                f"[{self.name}] the checkpoint's generation_config ({settings}) is not used: rollouts sample "
                "softmax(logits / sampling.temperature), then sampling.top_k / sampling.top_p, nothing else"
            )
        rollout = self.config.rollout
        if rollout.async_steps and rollout.mode == "server":
            # the producer process owns the server (its weights are the version it draws with); this
            # process's own engine serves held-out evaluation and regenerated batches with the current weights
            rollout = dataclasses.replace(rollout, engine="auto", mode="colocate")
            self.accelerator.print(
                f"[{self.name}] the producer samples from the vLLM server; held-out evaluation samples here "
                f"(rollout.engine=auto: {choose_engine(policy)[0]})"
            )
        self.engine = build_engine(rollout, policy, self.tokenizer, self.config.model.path, self.config.run.seed)
        half = self.accelerator.mixed_precision != "no" or next(policy.parameters()).dtype in (
            torch.bfloat16,
            torch.float16,
        )
        if self.engine.logprobs_exact and half:
            # in half precision the sampler's forward and the training layout (packed rows, the prompt cache,
            # other micro-batches) round differently: the first-minibatch ratio was 1.002-1.0035, not 1
            self.engine.logprobs_exact = False
            self.accelerator.print(
                f"[{self.name}] half precision: the old log-probs are recomputed by the training forward "
                "(rollout/logprob_diff_* is the sampler's rounding)"
            )
        self.monitor = RunMonitor(self.config, self.eval_prompts, self.tokenizer, self.accelerator, *self.SCORE_KEYS)

    def generate(self, prompts: list[PromptExample], n: int) -> tuple[Rollout, dict]:
        """``sample``: ``n`` responses to each prompt from the current policy. Under ZeRO-3 and FSDP2 the
        policy's shards are gathered for the rollout and released after (``engines.full_parameters``)."""
        with engines.full_parameters(self.accelerator, self.actor.model):
            if self.env is not None:
                return sample_episodes(
                    self.engine, self.policy, self.env, self.config, self.tokenizer, prompts, n, self.context
                )
            return sample(self.engine, self.policy, prompts, self.config.sampling, n)

    def next_rollout(self, step: int, count: int, n: int) -> tuple[Rollout | None, dict | None, dict]:
        """(rollout, its reward columns, metrics) of step ``step``: ``n`` samples of each of this process's
        next ``count`` prompts. Synchronous (``rollout.async_steps=0``): drawn now by the current policy.
        Asynchronous: the batch the producer drew ahead, ``async_steps`` versions ago, after asking it for
        the batches up to step + async_steps; a batch older than ``rollout.max_staleness`` is dropped
        (rollout None) or drawn again now (``rollout.on_stale``), never trained on as it is."""
        acc = self.accelerator
        if self.producer is None:
            rollout, columns = self.generate(self.sampler.take_for_process(count, self.prompts, acc), n)
            return rollout, columns, {}
        producer, rollout_config = self.producer, self.config.rollout
        for batch in range(
            max(producer.requested, default=step - 1) + 1, min(step + producer.steps_ahead, self.total_steps - 1) + 1
        ):
            producer.request(batch, self.sampler.take_for_process(count, self.prompts, acc), n)
        rollout, request, times = producer.take(step)
        staleness, tally = step - rollout.version.to(torch.float64), Tally()
        tally.add("sum", staleness.sum())
        tally.add("rows", len(staleness))
        tally.add("staleness_max", staleness.max())
        reduce_tallies(acc, tally)  # now, in one collective: the largest staleness decides the batch's fate
        metrics = {
            "rollout/staleness_mean": tally.reduced["sum"] / max(tally.reduced["rows"], 1.0),
            "rollout/staleness_max": tally.reduced["staleness_max"],
            "time/wait_rollout": times["wait"],
            "time/producer_idle": times["producer_idle"],
            "time/producer_generate": times["producer_generate"],
        }
        stale = metrics["rollout/staleness_max"] > rollout_config.staleness_bound  # every process decides alike
        metrics["rollout/stale_batches"] = float(stale)
        if stale and rollout_config.on_stale == "drop":
            self.console_warning(
                f"step {step + 1}: its batch was drawn {metrics['rollout/staleness_max']:g} versions ago, more than "
                f"rollout.max_staleness={rollout_config.staleness_bound}: dropped, no update (rollout.on_stale=drop)"
            )
            return None, None, metrics
        if stale:  # regenerate: this step's prompts, drawn again by the current policy
            rollout, _ = self.generate(request.prompts, request.n)
            rollout.version = torch.full((len(rollout),), step, dtype=torch.long)
        return rollout, rollout.columns, metrics

    def start_producer(self, start_step: int, state: dict | None) -> None:
        """The asynchronous producer (``rollout.async_steps`` ≥ 1) from version ``start_step``, holding the
        batches a resumed checkpoint saved; its threads are taken from this process's."""
        self.producer = None
        cfg, acc = self.config, self.accelerator
        if not cfg.rollout.async_steps:
            return
        if cfg.rollout.mode == "server" and acc.num_processes > 1:
            raise UserError(
                "rollout.async_steps with rollout.mode=server runs on one training process: the producers of "
                "several processes would load their weights into the one server between each other's requests"
            )

        threads = max(1, torch.get_num_threads() - cfg.rollout.producer_threads)
        torch.set_num_threads(threads)
        acc.print(
            f"[{self.name}] asynchronous rollouts: a producer process draws {cfg.rollout.async_steps} step(s) ahead "
            f"on {cfg.rollout.producer_threads} thread(s); the trainer keeps {threads}"
        )
        self.producer = Producer(
            self.policy,
            cfg.rollout,
            cfg.sampling,
            cfg.model.tokenizer_path or cfg.model.path,
            cfg.model.path,
            cfg.run.seed,
            acc.process_index,
            start_step,
        )
        if state is not None:
            self.producer.load_queue(state["checkpoint"], acc.process_index, acc.num_processes)

    # -- what a subclass provides -------------------------------------------------------------------

    def train_step(self, step: int, timer: PhaseTimer) -> tuple[dict, Rollout | None, torch.Tensor | None]:
        """One rollout batch: (metrics, rollout, scores [B]); rollout None = nothing to train on."""
        raise NotImplementedError

    def before_first_step(self) -> None:
        """What a fresh run does before its first update, after the held-out evaluation of the starting policy
        (PPO: value pretraining); a resumed run did it before its checkpoint."""

    def logprobs_of(self, rollout: Rollout, rows: slice) -> torch.Tensor:
        """The policy's training forward: log-probs [b, T] of the response tokens of ``rows``."""
        return policy_logprobs(self.actor.model, rollout, rows, self.accelerator.device, shared=self.shared)[0]

    def models_to_save(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.actor.model}

    def nonfinite_skips(self) -> int:
        return self.actor.guard.skips

    def state(self) -> dict:
        """The trainer state saved in a checkpoint besides the models and optimizers."""
        return {"prompt_cursor": self.sampler.cursor}

    def load_state(self, state: dict) -> int:
        """Restore ``state`` (a checkpoint's); returns the step to continue from."""
        self.sampler.cursor = state["prompt_cursor"]
        return state["step"]

    # -- the loop ---------------------------------------------------------------------------------------

    @signals.handles_stop_signals  # SIGTERM / SIGINT: the step finishes, a checkpoint is saved, exit 143 / 130
    def train(self, callbacks: tuple[Callable[[int, dict], None], ...] = ()) -> dict:
        """Resume (``run.resume_from``), run ``train_step`` + weight sync + ``end_step`` for every step,
        save ``final/``. Returns {"final_metrics", "steps", "output_dir", "processes", **state}."""
        cfg, acc = self.config, self.accelerator
        state, self.logger = start_run(acc, cfg, self.total_steps, self.name)
        start_step = 0 if state is None else self.load_state(state)
        if state is None:
            # every process was seeded alike for identical model init; sampling needs a stream per process
            # (or two processes given one prompt draw the same responses), and one that does not depend on
            # how the frozen roles were loaded (a teacher's forward here or in vLLM: the same samples). A
            # resume restores each one's.
            torch.manual_seed(cfg.run.seed + acc.process_index)
        if state is not None:
            self.monitor.resume(cfg.run.output_dir)
        self.sync_weights()  # a resumed policy is not the checkpoint the engine loaded
        if start_step == 0:
            self.evaluate_at_start()
            self.before_first_step()
        threads = torch.get_num_threads()
        try:
            self.start_producer(start_step, state)
            metrics = self.run_steps(start_step, callbacks)
        finally:
            if self.producer is not None:
                self.producer.close()
            torch.set_num_threads(threads)  # the producer's share back, for what the process runs next
        self.logger.close()
        save_final(acc, cfg.run.output_dir, self.models_to_save(), self.tokenizer)
        engines.release_freed_memory()
        return {
            "final_metrics": metrics,
            "steps": self.total_steps,
            "output_dir": cfg.run.output_dir,
            "processes": acc.num_processes,
            **self.state(),
        }

    def run_steps(self, start_step: int, callbacks) -> dict:
        """``train_step`` + weight sync + ``end_step`` for steps ``start_step`` … the last; the last metrics."""
        metrics: dict = {}
        for step in range(start_step, self.total_steps):
            t0, timer = time.perf_counter(), PhaseTimer()
            lr = self.actor.scheduler.get_last_lr()[0]  # the rate of this step's first update
            metrics, rollout, scores = self.train_step(step, timer)
            if self.producer is not None:  # every step is a version, trained or not: the schedule stays fixed
                with timer("sync_weights"), engines.full_parameters(self.accelerator, self.actor.model):
                    self.producer.publish(self.policy, step + 1)
            if rollout is None:
                metrics.update(self.step_metrics.flush(self.accelerator))
                self.logger.log(step + 1, metrics)
                self.logger.advance()
                self.save_if_due(step + 1)
                self.stop_if_signalled(step + 1)
                continue
            if self.producer is None:
                with timer("sync_weights"):
                    self.sync_weights()
            metrics["lr"] = lr
            self.end_step(step + 1, metrics, rollout, scores, timer.read(time.perf_counter() - t0), callbacks)
            self.stop_if_signalled(step + 1)
        return metrics

    def evaluate_at_start(self) -> None:
        """The held-out evaluation of the starting policy, logged as step 0 before any update
        (``eval.at_start``): the baseline the report plots and alert 7 compares with."""
        acc = self.accelerator
        if not self.monitor.evaluating(0, self.total_steps):
            return
        with engines.full_parameters(acc, self.actor.model), self.engine.generating(self.policy):
            metrics = self.monitor.after_step(self.engine, 0, self.total_steps, {})
        self.logger.log(0, metrics, self.monitor.bar_keys)

    def sync_weights(self) -> None:
        """Hand the rollout engine the policy's current weights (a no-op for hf/lean, which sample from
        the module itself). Under ZeRO-3 the shards are gathered whole for the hand-over (a collective)
        and released after; FSDP2's shards are gathered by ``policy_weights`` itself. A sleeping colocated
        vLLM takes the weights when it wakes for a rollout (inside ``generate``'s gather) instead."""
        rollout = self.config.rollout
        sleeping = rollout.mode == "colocate" and rollout.sleep
        gather = rollout.engine == "vllm" and not sleeping and engines.zero_stage(self.accelerator) == 3
        with engines.full_parameters(self.accelerator, self.actor.model) if gather else contextlib.nullcontext():
            self.engine.sync_weights(self.policy)

    def end_step(self, done: int, metrics: dict, rollout: Rollout, scores, times: dict, callbacks) -> None:
        """The tail of every step: response, time and throughput metrics, and the step's metric sums reduced
        over the processes at once (``step_metrics``); ``samples.jsonl``; held-out evaluation and alerts
        (``RunMonitor``); the log; a checkpoint when due (``save_if_due``); callbacks."""
        cfg, acc = self.config, self.accelerator
        response_metrics(self.step_metrics, rollout)
        metrics.update(self.step_metrics.flush(acc))
        metrics.update(times)
        metrics["train/nonfinite_skips"] = self.nonfinite_skips()
        metrics["tokens_per_s"] = metrics["tokens_generated"] / times["time/step"]
        write_samples(acc, cfg.run.output_dir, done, rollout, scores, cfg.log_completions, self.tokenizer)
        with contextlib.ExitStack() as generating:
            if self.monitor.evaluating(done, self.total_steps):  # held-out generation through the engine:
                generating.enter_context(engines.full_parameters(acc, self.actor.model))  # the policy whole
                generating.enter_context(self.engine.generating(self.policy))  # a sleeping vLLM awake
            metrics.update(self.monitor.after_step(self.engine, done, self.total_steps, metrics))
        if done % cfg.run.log_every == 0 or done == self.total_steps or "time/eval" in metrics:
            self.logger.log(done, metrics, (*self.BAR_KEYS, *self.monitor.bar_keys))
        self.logger.advance()
        self.save_if_due(done)
        for callback in callbacks:
            callback(done, metrics)

    def save_if_due(self, done: int) -> None:
        """A checkpoint after step ``done`` when ``loop.checkpoint_due``: every ``run.save_every`` and the last."""
        if checkpoint_due(self.config.run, done, self.total_steps):
            self.save(done)

    def save(self, done: int):
        """Checkpoint ``done`` (``checkpoint.save_checkpoint``); returns its folder."""
        cfg, producer, acc = self.config, self.producer, self.accelerator
        folder = save_checkpoint(
            acc,
            cfg.run.output_dir,
            done,
            self.models_to_save(),
            self.tokenizer,
            self.state(),
            cfg.run.keep_last,
            per_process=None if producer is None else lambda tmp: producer.save_queue(tmp, acc.process_index),
            last=done == self.total_steps,
        )
        if producer is not None:
            producer.last_checkpoint = str(folder)
        return folder

    def stop_if_signalled(self, done: int) -> None:
        """After step ``done``: on SIGTERM / SIGINT, a checkpoint, one line saying where, exit 143 / 130
        (``signals.stop_if_signalled``)."""
        run, total = self.config.run, self.total_steps
        due = checkpoint_due(run, done, total)
        save = lambda: self.save(done)  # noqa: E731
        signals.stop_if_signalled(self.accelerator, self.name, run.output_dir, done, total, due, save, self.logger)


# -- the update skeleton ------------------------------------------------------------------------------


def minibatches(
    num_rows: int, passes: int, count: int, seed: int, step: int, shuffle: bool = True
) -> Iterator[tuple[int, list[int]]]:
    """(pass, rows) for ``passes`` passes over a rollout of ``num_rows`` rows, each pass split into
    ``count`` minibatches (``split_minibatches``; every row trained). The rows of pass p of step s are
    shuffled by a generator seeded from (run seed, s, p) alone, so a resumed run draws the same
    minibatches; ``shuffle=False`` keeps the rollout's order."""
    for p in range(passes):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + p)
        order = torch.randperm(num_rows, generator=generator) if shuffle else torch.arange(num_rows)
        for rows in split_minibatches(order, count):
            yield p, rows


def first_minibatch_metrics(first: dict[str, float]) -> dict[str, float]:
    """The ratio range and clip fraction of the first minibatch of a step, where the policy still is the
    sampling policy: the ratio must be 1 there (max = min = 1, clipfrac 0) unless the old log-probs are
    not the sampler's (docs/pitfalls.md #4)."""
    return {f"policy/first_minibatch_{k}": first[k] for k in ("ratio_max", "ratio_min", "clipfrac")}


@dataclass
class PromptSampler:
    """Prompts in seeded per-epoch permutations, read through a cursor that survives checkpoints.

    The cursor (prompts read so far) is part of the trainer state, so a resumed run reads the same
    prompts even when dynamic sampling draws a varying number of them per step.
    """

    num_prompts: int
    seed: int
    cursor: int = 0

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            epoch, k = divmod(self.cursor, self.num_prompts)
            order = torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + epoch))
            out.append(int(order[k]))
            self.cursor += 1
        return out

    def take_for_process(self, k: int, prompts: list, accelerator) -> list:
        """This process's k prompts of the next k × processes: every process advances the cursor alike."""
        indices = self.take(k * accelerator.num_processes)
        mine = indices[accelerator.process_index * k : (accelerator.process_index + 1) * k]
        return [prompts[i] for i in mine]


def check_episodes(config) -> None:
    """What a run with ``env`` cannot combine with, refused at start."""
    env = config.env
    if not env.enabled:
        return
    if config.rollout.async_steps:
        raise ValueError(
            "env with rollout.async_steps >= 1: the asynchronous producer samples one turn per prompt; run episodes "
            "synchronously (rollout.async_steps=0)"
        )
    if getattr(config, "overlong_buffer_fraction", 0.0) > 0:
        preset = getattr(config, "preset", "none")
        by = (
            f" (preset={preset} sets it)"
            if preset != "none" and "overlong_buffer_fraction" in config.PRESETS[preset]
            else ""
        )
        raise ValueError(
            f"overlong_buffer_fraction={config.overlong_buffer_fraction}{by} with env: DAPO's overlong penalty "
            "measures one response against sampling.max_new_tokens, an episode's budget is env.max_episode_tokens "
            "over several turns; set overlong_buffer_fraction=0"
        )
    if config.sampling.max_new_tokens > env.max_episode_tokens:
        raise ValueError(
            f"sampling.max_new_tokens={config.sampling.max_new_tokens} (one turn) is more than "
            f"env.max_episode_tokens={env.max_episode_tokens} (the whole episode after its prompt): lower "
            "sampling.max_new_tokens or raise env.max_episode_tokens"
        )
    if env.name in UNSCORED and not config.rewards and getattr(config, "reward_model", None) is None:
        raise ValueError(
            f"env.name={env.name} gives no reward of its own: rewards must score the model's last turn, e.g. "
            "rewards=[{function: posttrain.rewards.builtin:exact_answer}] with an answer column"
        )


def start_environment(config, tokenizer, first: PromptExample, context, say, name: str) -> Environment | None:
    """The environment of ``config.env`` (None without one), told the run's tokenizer; what it is and the first
    episode's prompt as the model reads it (the environment's messages, a tool description, included) printed,
    and checked against the model's ``context`` positions (``check_fits``) before any step."""
    env_config: EnvConfig | None = getattr(config, "env", None)
    env = environment_for(env_config, tokenizer)
    if env is None:
        return None
    say(
        f"[{name}] episodes in env={env_config.name}: at most {env_config.max_turns} turns and "
        f"{env_config.max_episode_tokens} tokens after the prompt; the environment's tokens are masked out of training"
    )
    ids = prompt_ids(tokenizer, first_messages(env, first.row), env.tools)
    say(f"[{name}] the first episode's prompt as the model reads it: {tokenizer.decode(ids)!r}")
    check_fits(ids, env_config, context, first.row)
    return env


def sample_episodes(engine: RolloutEngine, policy, env: Environment, config, tokenizer, prompts, n: int, context):
    """A rollout of ``n`` episodes per prompt in ``env`` (``posttrain.envs.run_episodes``; ``context``: the
    model's positions), and its columns (the prompt rows' and the episodes': ``environment_reward``, turns, ...)."""
    rows = [p.row for p in prompts]
    with engine.generating(policy):
        rollout = run_episodes(engine, env, config.env, tokenizer, rows, config.sampling, n, context)
    return rollout, rollout.columns


def write_samples(
    accelerator, output_dir, step: int, rollout: Rollout, scores: torch.Tensor, n: int, tokenizer=None
) -> None:
    """Append the first ``n`` (prompt, completion, score) of this step to ``samples.jsonl``: the text the
    numbers are about, to read next to metrics.jsonl (main process only). ``prompt`` / ``completion`` are the
    texts the rewards read (special tokens removed); ``prompt_text`` / ``completion_text`` what the model read
    and wrote (the chat template, ``<|im_end|>``); then the row's other columns (``answer``)."""
    if n <= 0 or not accelerator.is_main_process:
        return
    import json
    from pathlib import Path

    with open(Path(output_dir) / "samples.jsonl", "a", encoding="utf-8") as f:
        for i in range(min(n, len(rollout))):
            record = {
                "step": step,
                "prompt": rollout.prompts[i],
                "completion": rollout.responses[i],
                "score": float(scores[i]),
                "truncated": bool(rollout.truncated[i]),
            }
            if tokenizer is not None:
                record["prompt_text"], record["completion_text"] = rollout.texts(tokenizer, i)
            for key, values in rollout.columns.items():
                record.setdefault(key, values[i])
            f.write(json.dumps(record, default=str) + "\n")


def split_minibatches(order: torch.Tensor, minibatches: int) -> list[list[int]]:
    """Every row of ``order`` [B] in min(minibatches, B) consecutive minibatches whose sizes differ by at
    most one (B = 16 in 3: 6, 5, 5). No row is left out; each minibatch is one optimizer step whose loss
    is normalised by its own units, so uneven sizes weigh every row alike within a step."""
    return [part.tolist() for part in torch.tensor_split(order, min(minibatches, len(order)))]


def reference_logprobs(
    reference: Reference, rollout: Rollout, micro_batch_size: int, device, shared: SharedPrefix | None = None
) -> torch.Tensor:
    """log π_ref of the response tokens, [B, T], in micro-batches (no grad); a micro-batch's samples of
    one prompt share it in one packed row when ``shared`` says so (``runtime.prefix``)."""
    ids, mask = rollout.input_ids.to(device), rollout.attention_mask.to(device)
    parts = []
    for s in micro_slices(len(rollout), micro_batch_size):
        packed = packed_rollout_rows(rollout, s, shared)
        model = reference.model if reference.model is not None else reference.policy
        if packed is None and prompt_cache_applies(model, shared):
            parts.append(
                reference.prompt_cached_logprobs(
                    rollout.prompt_ids[s],
                    rollout.prompt_mask[s],
                    rollout.response_ids[s],
                    rollout.prompt_index[s],
                    rollout.temperature,
                ).to(device)
            )
        elif packed is None:
            parts.append(reference.logprobs(ids[s], mask[s], rollout.response_length, rollout.temperature))
        else:
            batch, response_of_row = packed
            logprobs = reference.shared_prefix_logprobs(batch.to(device), rollout.temperature)
            parts.append(unpack_rows(logprobs, response_of_row, rollout.response_length))
    return torch.cat(parts)


def policy_logprobs(
    model,
    rollout: Rollout,
    rows: slice,
    device,
    with_entropy: bool = False,
    entropy_grad=False,
    shared: SharedPrefix | None = None,
):
    """Training forward of the policy on ``rows`` of the rollout at the sampling temperature:
    (log-probs [b, T], entropy [b, T] or None); packed by prompt when ``shared`` says so."""
    packed = packed_rollout_rows(rollout, rows, shared)
    if packed is not None:
        batch, response_of_row = packed
        logprobs, entropy, _ = shared_prefix_logprobs(
            model, batch.to(device), rollout.temperature, with_entropy, entropy_grad
        )
        length = rollout.response_length
        return unpack_rows(logprobs, response_of_row, length), unpack_rows(entropy, response_of_row, length)
    if prompt_cache_applies(model, shared):
        return prompt_cached_logprobs(
            model,
            *(t[rows].to(device) for t in (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids)),
            rollout.prompt_index[rows].to(device),
            temperature=rollout.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
    return response_logprobs(
        model,
        rollout.input_ids[rows].to(device),
        rollout.attention_mask[rows].to(device),
        rollout.response_length,
        temperature=rollout.temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


def old_logprobs_of(
    accelerator,
    engine: RolloutEngine,
    rollout: Rollout,
    forward,
    micro_batch_size: int,
    config: RolloutConfig,
    step: StepMetrics | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """(old_logprobs [B, T], importance weights [B, T] or None, metrics) of a fresh rollout.

    An engine whose log-probs are the training forward's (HF, lean) gives the old log-probs itself, when it
    drew the rollout in this process with the current weights. Any other rollout (vLLM: its own kernels and
    sampler; the asynchronous producer: older weights) gets one no-grad training forward, ``forward(rollout,
    rows)``, at the sampling temperature (docs/pitfalls.md #4); the behaviour policy's log-probs that came
    with it are then compared with it (``rollout/logprob_diff_mean|max``, mean and max |π_old − π_behaviour|
    over response tokens in log space) and, when ``config.importance_sampling`` is set, turned into importance
    weights (``importance_weights``). With ``step`` these metrics are reduced at the end of the step (metrics {}).
    """
    if engine.logprobs_exact and rollout.version is None:
        return rollout.logprobs, None, {}
    with torch.no_grad():
        old = torch.cat([forward(rollout, s) for s in micro_slices(len(rollout), micro_batch_size)])
    if rollout.logprobs is None:
        return old, None, {}
    tally = OffPolicyTally()  # the same gap and weight metrics as a one-pass update's, summed the same way
    valid = rollout.action_mask.bool().to(old.device)
    weights = tally.weights(old, rollout.logprobs.to(old.device), valid, config)
    if step is not None:
        step.include(tally.tally, lambda: tally.metrics(weights is not None))
        return old, weights, {}
    return old, weights, tally.result(accelerator, weights is not None)


def importance_weights(
    old: torch.Tensor, behaviour: torch.Tensor, valid: torch.Tensor, config: RolloutConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, T], outside [B, T] bool) of ``config.importance_sampling``: truncated (token, sequence:
    ``core.truncated_importance_weights``; outside = the ratio was capped) or masked (token_mask,
    sequence_mask: ``core.masked_importance_weights``; outside = the token was dropped, its weight 0 as the
    papers' objectives have it, while the loss's normalisation still counts it)."""
    mode = config.importance_sampling
    if mode in ("token", "sequence"):
        weights = truncated_importance_weights(old, behaviour, valid, mode, config.importance_cap)
        raw = truncated_importance_weights(old, behaviour, valid, mode, math.inf)
        return weights, raw > config.importance_cap
    low, high = config.importance_band
    weights, keep = masked_importance_weights(old, behaviour, valid, mode.removesuffix("_mask"), low, high)
    return weights, valid & ~keep


class OffPolicyTally:
    """The sampler/trainer gap, importance-weight and KL metrics, tallied part by part on the device and reduced
    over the processes once: over the whole batch in ``old_logprobs_of``, or micro-batch by micro-batch when π_old
    is the training forward itself (a GRPO update of one pass over one minibatch on an asynchronous batch, whose
    old log-probs are the first forward's, detached, so the separate no-grad pass is not run; reduced with the
    update's statistics, ``StepStats.result``)."""

    def __init__(self):
        self.tally = Tally()
        self.with_kl = False

    def weights(self, old, behaviour, valid, config: RolloutConfig) -> torch.Tensor | None:
        """Importance weights [b, T] of ``config.importance_sampling`` (None: none), tallying the gap."""
        diff = torch.where(valid, (old - behaviour).abs(), 0.0)
        self.tally.add("tokens", valid.sum())
        self.tally.add("diff", diff.sum())
        self.tally.add("diff_max", diff.max())
        if config.importance_sampling == "none":
            return None
        weights, outside = importance_weights(old, behaviour, valid, config)
        self.tally.add("weight", torch.where(valid, weights, 0.0).sum())
        self.tally.add("outside", (outside & valid).sum())
        self.tally.add("weight_max", torch.where(valid, weights, 0.0).max())
        return weights

    def kl(self, kl: torch.Tensor, mask: torch.Tensor) -> None:
        """The KL to the reference [b, T] over ``mask`` (the loss mask: the tokens that train), tallied as
        ``kl_metrics`` tallies the separate pass's."""
        for key, value in kl_sums(kl, mask).items():
            self.tally.add(f"kl.{key}", value)
        self.with_kl = True

    def result(self, accelerator, importance: bool) -> dict[str, float]:
        """The metrics, after reducing the tally on its own (one collective)."""
        reduce_tallies(accelerator, self.tally)
        return self.metrics(importance)

    def metrics(self, importance: bool) -> dict[str, float]:
        """The metrics of the reduced tally."""
        total = self.tally.reduced
        tokens = max(total["tokens"], 1.0)
        out = {"rollout/logprob_diff_mean": total["diff"] / tokens, "rollout/logprob_diff_max": total["diff_max"]}
        if importance:
            out["rollout/importance_weight_mean"] = total["weight"] / tokens
            out["rollout/importance_weight_max"] = total["weight_max"]
            out["rollout/importance_clipped_share"] = total["outside"] / tokens
        if self.with_kl:
            out.update(kl_finish({key: total[f"kl.{key}"] for key in ("tokens", "total", "rows")}))
        return out


def gather_whiten(accelerator, values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``core.masked_whiten`` with μ and σ over every process's rows, returned for this process's rows.

    values, mask: [B, T] (or [B] with a mask of ones). Rows of other processes are padded to one T.
    In float64: the variance of float32 rewards of 1e20 or more overflows float32.
    """
    dtype, values = values.dtype, values.double()
    if accelerator.num_processes == 1:
        return masked_whiten(values, mask, shift_mean).to(dtype)
    local_rows = values.shape[0]
    padded_values = accelerator.pad_across_processes(values, dim=-1)
    padded_mask = accelerator.pad_across_processes(mask, dim=-1)
    all_values, all_mask = accelerator.gather(padded_values), accelerator.gather(padded_mask)
    whitened = masked_whiten(all_values, all_mask, shift_mean)
    start = accelerator.process_index * local_rows  # every process holds the same number of rows
    return whitened[start : start + local_rows, : values.shape[-1]].to(dtype)


def global_min(accelerator, value: int) -> int:
    if accelerator.num_processes == 1:
        return int(value)
    tensor = torch.tensor([value], dtype=torch.long, device=accelerator.device)
    return int(accelerator.gather(tensor).min())


def response_metrics(step: StepMetrics, rollout: Rollout) -> None:
    """Response length mean/min/max (the tokens the policy sampled), share truncated and tokens generated,
    over all processes, added to ``step``; with episodes, ``episode_metrics`` too."""
    lengths = rollout.response_lengths.double()

    def finish(t: dict[str, float]) -> dict[str, float]:
        return {
            "response_length/mean": ratio(t["length"], t["rows"]),
            "response_length/min": t["length_min"],
            "response_length/max": t["length_max"],
            "truncated_share": ratio(t["truncated"], t["rows"]),
            "tokens_generated": t["length"],
        }

    step.add(
        "response",
        finish,
        rows=len(lengths),
        length=lengths.sum(),
        length_min=lengths.min(),
        length_max=lengths.max(),
        truncated=rollout.truncated.sum(),
    )
    if rollout.sampled_mask is not None:  # episodes
        episode_metrics(step, rollout)


def episode_metrics(step: StepMetrics, rollout: Rollout) -> None:
    """Per episode, over all processes: turns, tool calls and tool errors (means), how episodes ended (the share
    of each of ``posttrain.envs.ENDS``), environment tokens; the seconds ``env.step`` took, summed over the
    episodes of a process (the largest process's sum). Added to ``step``."""
    columns = rollout.columns
    per_episode = torch.tensor(
        [
            columns["turns"],
            columns["tool_calls"],
            columns["tool_errors"],
            *([float(end == e) for end in columns["end"]] for e in ENDS),
            (rollout.response_mask - rollout.action_mask).sum(1).tolist(),
        ],
        dtype=torch.float64,
    )
    names = ["turns_mean", "tool_calls_mean", "tool_errors_mean", *(f"end_{e}_share" for e in ENDS), "env_tokens_mean"]

    def finish(t: dict[str, float]) -> dict[str, float]:
        means = {f"episode/{k}": ratio(t[k], t["episodes"]) for k in names}
        return {**means, "time/env": t["env_seconds_max"]}

    sums = dict(zip(names, per_episode.sum(1), strict=True))
    step.add("episode", finish, episodes=per_episode.shape[1], env_seconds_max=sum(columns["env_seconds"]), **sums)


def kl_metrics(step: StepMetrics, kl: torch.Tensor, mask: torch.Tensor) -> None:
    """KL per token and per sequence (``kl_finish``) over ``mask`` [B, T] (1 = the token trains) of every
    process, added to ``step``."""
    step.add("kl", kl_finish, **kl_sums(kl, mask))


def kl_sums(kl: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The local sums the KL metrics come from, added up over micro-batches and processes: the tokens of
    ``mask`` [B, T], their KL ``kl`` [B, T] summed (garbage where the mask is 0 is selected away), and the rows
    with a token in the mask (a row without one, unscored or left out, is in neither sum)."""
    valid = mask.bool()
    return {"tokens": valid.sum(), "total": torch.where(valid, kl, 0.0).sum(), "rows": valid.any(-1).sum()}


def kl_finish(t: dict[str, float]) -> dict[str, float]:
    """``kl/per_token`` (the masked mean) and ``kl/per_sequence`` (the mean over the rows that train of each
    row's sum) from the totals of ``kl_sums``; 0 without a token."""
    return {"kl/per_token": t["total"] / max(t["tokens"], 1.0), "kl/per_sequence": t["total"] / max(t["rows"], 1.0)}


def advantage_metrics(step: StepMetrics, advantages: torch.Tensor, mask: torch.Tensor) -> None:
    """Mean and std of the advantages over the valid tokens of every process, added to ``step``."""
    valid = mask.bool()

    def finish(t: dict[str, float]) -> dict[str, float]:
        mean, mean_sq = t["total"] / max(t["count"], 1.0), t["total_sq"] / max(t["count"], 1.0)
        return {"advantages/mean": mean, "advantages/std": max(mean_sq - mean**2, 0.0) ** 0.5}

    step.add(
        "advantages",
        finish,
        count=valid.sum(),
        total=torch.where(valid, advantages, 0.0).sum(),
        total_sq=torch.where(valid, advantages.square(), 0.0).sum(),
    )

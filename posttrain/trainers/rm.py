"""Reward models from human rankings (InstructGPT, Ouyang et al. 2022, eq. 1).

    loss = mean over rankings of  mean_{i<j} −log σ(r(x, y_i) − r(x, y_j) − margin)   [+ centering]

A ranking A > B > C > D gives all C(4, 2) = 6 ordered pairs, counted as one example; a preference pair
is a ranking of K = 2 (Bradley–Terry). Optional reward centering (Eisenstein et al. 2023) adds
``center_coef · mean over pairs of (r_i + r_j)²`` so scores stay near 0. After training, the head can be
normalised so that scores of samples from a reference policy have mean 0 and std 1; the mean and std
are stored in the checkpoint's config.json (``reward_normalization``) and applied by
``posttrain.models.sequence_scores``.

With ``shared_prefix`` (default auto) a ranking is one row, the prompt then its K responses
(``core.packing``): the prompt is computed once instead of K times, each score read at its response's
last token; the scores are the same up to float rounding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from posttrain.core import SharedPrefixBatch, pack_shared_prefix, ranking_loss, ranking_pairs
from posttrain.data import (
    DataConfig,
    RankingExample,
    SequenceBatch,
    collate,
    load_preferences,
    load_prompts,
    load_rankings,
)
from posttrain.data.datasets import first_row
from posttrain.models import (
    ModelConfig,
    RewardScorer,
    adapter_base,
    load_causal_lm,
    load_reward_model,
    load_scalar_model,
    load_tokenizer,
    peft_wrapping,
    sequence_scores,
    unwrap_model,
)
from posttrain.monitor.alerts import RM_RULES, AlertConfig, HealthMonitor, describe_length_probe, length_preference
from posttrain.monitor.run import offline_alerts
from posttrain.runtime.config import (
    PLACED_BY_ACCELERATE,
    OptimConfig,
    RunConfig,
    check_choice,
    reject_ignored,
    validate_sections,
)
from posttrain.runtime.loop import Trainable, begin_offline, run_offline, save_final
from posttrain.runtime.prefix import SharedPrefix, check_shared_prefix, resolve_shared_prefix
from posttrain.runtime.runlock import holds_run_dir

DATA_FORMATS = ("auto", "pairs", "rankings")


@dataclass
class RMConfig:
    """posttrain rm."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Backbone to train: a causal LM (a new one-output head is added) or a reward-model checkpoint;
    ``model.lora`` trains a LoRA adapter and the head, saved as an adapter (head in modules_to_save)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Pairs {"prompt", "chosen", "rejected"} or rankings {"prompt", "responses": [best, ..., worst]}."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps, batches, logging, checkpoints."""
    data_format: str = "auto"
    """pairs, rankings, or auto (pairs when the first row has 'chosen')."""
    margin: float = 0.0
    """The better response must win by this much (Llama 2's margin loss); 0 = plain Bradley–Terry."""
    center_coef: float = 0.0
    """Reward-centering coefficient (Eisenstein et al. 2023); 0 = off."""
    normalize_policy: str | None = None
    """After training, sample from this policy on the training prompts and normalise scores to mean 0, std 1."""
    normalize_samples: int = 64
    """How many policy samples the normalisation uses."""
    normalize_max_new_tokens: int = 64
    """Length limit of those samples."""
    shared_prefix: bool | str = "auto"
    """One row per ranking: the prompt once, then its K responses, each attending to the prompt and to
    itself only (position ids continue from the prompt in each), its score read at its own last
    token: the prompt is computed once instead of K times. auto: when the model takes such a 4-D
    attention mask exactly (sdpa or eager attention, no sliding window; otherwise the reason is
    printed) and the packed micro-batch costs fewer FLOPs; true: always (an error if the model
    cannot); false: never. Scores equal the unpacked ones up to float rounding."""
    length_probe: int = 64
    """After training, score this many held-out best responses (training ones when none are held out) once and
    said twice (``length_probe``): a warning when the longer one scores higher in more than half the pairs; 0 = off."""

    def validate(self) -> None:
        validate_sections(self)
        reject_ignored(
            self,
            {
                "model.device": PLACED_BY_ACCELERATE,
            },
        )
        check_choice("data_format", self.data_format, DATA_FORMATS)
        check_shared_prefix(self.shared_prefix)
        if self.center_coef < 0:
            raise ValueError(f"center_coef must be >= 0, got {self.center_coef}")
        if self.normalize_policy and self.model.lora is not None:
            raise ValueError(
                "normalize_policy with model.lora: the adapter checkpoint has no config.json to hold the "
                "normalisation; train the LoRA reward model, then normalise a merged copy"
            )
        if self.normalize_samples < 2:
            raise ValueError(f"normalize_samples must be >= 2, got {self.normalize_samples}")
        if self.length_probe < 0:
            raise ValueError(f"length_probe must be >= 0 (0 = off), got {self.length_probe}")


@dataclass
class RankingBatch:
    # Σ K_b rows: the responses of ranking b, best first, then those of b + 1; or one packed row per ranking
    sequences: SequenceBatch | SharedPrefixBatch
    ks: list[int]  # K of each ranking

    def to(self, device) -> RankingBatch:
        return RankingBatch(self.sequences.to(device), self.ks)

    @property
    def num_tokens(self) -> int:
        return self.sequences.num_tokens


class RMTask:
    def __init__(self, pad_id: int, margin: float, center_coef: float, shared: SharedPrefix | None = None):
        self.pad_id, self.margin, self.center_coef = pad_id, margin, center_coef
        self.shared = shared or SharedPrefix(enabled=False)

    def collate(self, examples: list[RankingExample]) -> RankingBatch:
        ks = [len(e.response_ids) for e in examples]
        padded = max(len(e.prompt_ids) + max(map(len, e.response_ids)) for e in examples)
        packed = max(len(e.prompt_ids) + sum(map(len, e.response_ids)) for e in examples)
        if all(e.prompt_ids for e in examples) and self.shared.pays(sum(ks), padded, len(examples), packed):
            sequences = pack_shared_prefix(
                [e.prompt_ids for e in examples], [e.response_ids for e in examples], self.pad_id
            )
            return RankingBatch(sequences, ks)
        pairs = [(e.prompt_ids, r) for e in examples for r in e.response_ids]
        return RankingBatch(collate(pairs, self.pad_id), ks)

    def count(self, batch: RankingBatch) -> int:
        return len(batch.ks)

    def scores(self, model, batch: RankingBatch) -> torch.Tensor:
        """One forward over every response of the batch: [Σ K_b] scores, ranking b's responses best
        first, then ranking b + 1's. ``model``: a ``RewardScorer``."""
        if isinstance(batch.sequences, SharedPrefixBatch):
            return model(packed=batch.sequences)
        return model(batch.sequences.input_ids, batch.sequences.attention_mask)

    def loss(self, model, batch: RankingBatch):
        return self.ranking_loss(self.scores(model, batch), batch.ks)

    def ranking_loss(self, scores: torch.Tensor, ks: list[int]):
        """The loss summed over the rankings and the sums ``finalize`` reads. scores: [Σ K_b] as
        ``scores`` returns them; the rankings of each K at once, [R_K, K]."""
        starts = torch.tensor([0, *ks[:-1]], device=scores.device).cumsum(0)
        k_of = torch.tensor(ks, device=scores.device)
        loss_sum = scores.new_zeros(())
        sums = {k: scores.new_zeros(()) for k in ("correct", "pairs", "margin", "score", "score_sq", "responses")}
        for k in sorted(set(ks)):  # rankings may differ in K
            first = starts[k_of == k]
            rankings = scores[first[:, None] + torch.arange(k, device=scores.device)]  # [R_K, K], best first
            loss_sum = loss_sum + ranking_loss(rankings, margin=self.margin) * len(first)
            better, worse = ranking_pairs(k, scores.device)
            diff = rankings[:, better] - rankings[:, worse]
            if self.center_coef:
                centered = (rankings[:, better] + rankings[:, worse]).square().mean(1).sum()
                loss_sum = loss_sum + self.center_coef * centered
            sums["correct"] += (diff > 0).sum()
            sums["pairs"] += diff.numel()
            sums["margin"] += diff.detach().sum()
            sums["score"] += rankings.detach().sum()
            sums["score_sq"] += rankings.detach().square().sum()
            sums["responses"] += rankings.numel()
        return loss_sum, {"loss_sum": loss_sum.detach(), **sums}

    def finalize(self, sums: dict, count: int) -> dict:
        n = max(sums["responses"], 1)
        mean = sums["score"] / n
        return {
            "loss": sums["loss_sum"] / max(count, 1),
            "accuracy": sums["correct"] / max(sums["pairs"], 1),
            "margin": sums["margin"] / max(sums["pairs"], 1),
            "score_mean": mean,
            "score_std": math.sqrt(max(sums["score_sq"] / n - mean**2, 0.0)),
        }


def load_ranking_data(config: RMConfig, tokenizer):
    """Rankings (pairs become rankings of K = 2) and the data report."""
    data_format = config.data_format
    if data_format == "auto":
        first = first_row(config.data)  # None: load_preferences says the data is empty
        data_format = "pairs" if first is None or "chosen" in first else "rankings"
    if data_format == "rankings":
        return load_rankings(config.data, tokenizer)
    pairs, report = load_preferences(config.data, tokenizer)
    return [RankingExample(p.prompt_ids, [p.chosen_ids, p.rejected_ids]) for p in pairs], report


@holds_run_dir  # the run folder stays locked until the run ends (runlock)
def train(config: RMConfig, callbacks=()) -> dict:
    """Train a reward model; writes ``<run.output_dir>/final/reward``: a *ForSequenceClassification, or with
    ``model.lora`` its adapter, which ``load_reward_model`` (AutoModelForSequenceClassification) loads."""
    first = "the first prompt and best response as the model reads them"
    start = begin_offline(config, "rm", lambda _, tokenizer: load_ranking_data(config, tokenizer), first)
    accelerator, tokenizer = start.accelerator, start.tokenizer
    model = load_scalar_model(replace(config.model, device="cpu"), "reward")
    if config.model.lora is not None:  # saved as an adapter whose modules_to_save hold the trained score head
        from peft import LoraConfig, get_peft_model

        with peft_wrapping():
            model = get_peft_model(
                model, LoraConfig(**{"task_type": "SEQ_CLS", "modules_to_save": ["score"], **config.model.lora})
            )
        adapter = model.peft_config["default"]
        adapter.base_model_name_or_path = adapter_base(config.model.path)
        # peft's SEQ_CLS wrapper appends its own "classifier", "score" to the list given: each name once
        adapter.modules_to_save = list(dict.fromkeys(adapter.modules_to_save))
    scorer = RewardScorer(model)  # trained through its forward: DDP synchronises its gradients
    shared = resolve_shared_prefix(config.shared_prefix, [model], lambda line: accelerator.print(f"[rm] {line}"))
    task = RMTask(tokenizer.pad_token_id, config.margin, config.center_coef, shared)
    callbacks = (*callbacks, *offline_alerts(accelerator, config.run.output_dir))  # a dead run says so
    result = run_offline(task, Trainable(scorer, {"reward": scorer}), start, config, callbacks, ("loss", "accuracy"))
    if config.normalize_policy:
        result["normalization"] = normalize_reward(model, tokenizer, config, accelerator.device)
        save_final(accelerator, config.run.output_dir, {"reward": model}, tokenizer)
    if config.length_probe:  # on the scores PPO reads (normalised, with normalize_policy)
        result["final_metrics"].update(_probe_length(config, start, task, scorer, result["steps"]))
    return result


def _probe_length(config: RMConfig, start, task: RMTask, scorer, step: int) -> dict[str, float]:
    """``length_probe`` on the held-out rankings' best responses (the training ones when none are held out),
    every process alike (a sharded model's forwards are collective); reported once."""
    where = "held-out" if start.eval_examples else "training"
    stop_ids = set(start.tokenizer.all_special_ids)
    examples = start.eval_examples or start.train_examples
    room = probe_room(config.data.max_length, scorer.model)
    pairs = length_probe_pairs(examples, stop_ids, config.length_probe, room)
    metrics = length_probe(task, scorer, pairs, config.run.micro_batch_size, start.accelerator.device)
    report_length_probe(start.accelerator, config.run.output_dir, step, metrics, where)
    return metrics


def normalize_reward(model, tokenizer, config: RMConfig, device) -> dict:
    """Score samples of ``config.normalize_policy`` on the training prompts; store their mean and std
    in ``model.config.reward_normalization`` so that ``sequence_scores`` returns (r − mean) / std."""
    from posttrain.rollout import HFEngine, SamplingParams

    policy = load_causal_lm(ModelConfig(path=config.normalize_policy, device=str(device)))
    prompts, _ = load_prompts(replace(config.data, on_malformed="skip"), tokenizer)
    prompt_ids = [p.prompt_ids for p in prompts[: config.normalize_samples]]
    engine = HFEngine(policy, tokenizer)
    generator_state = torch.get_rng_state()
    torch.manual_seed(config.run.seed)
    scores = []
    model.config.reward_normalization = None
    for i in range(0, len(prompt_ids), config.run.micro_batch_size):
        rollout = engine.generate(
            prompt_ids[i : i + config.run.micro_batch_size],
            SamplingParams(max_new_tokens=config.normalize_max_new_tokens),
        )
        with torch.no_grad():
            scores.append(sequence_scores(model, rollout.input_ids.to(device), rollout.attention_mask.to(device)))
    torch.set_rng_state(generator_state)
    scores = torch.cat(scores)
    stats = {"mean": float(scores.mean()), "std": float(scores.std().clamp(min=1e-6)), "samples": len(scores)}
    model.config.reward_normalization = stats
    return stats


# --------------------------------------------------------------------------------------------------
# the length probe: the same content, twice as long
# --------------------------------------------------------------------------------------------------


def length_probe_pairs(examples: list[RankingExample], stop_ids: set[int], count: int, max_length: int | None):
    """The length probe's pairs, rankings [best response said twice, said once] of up to ``count`` rankings.

    A response ends in the tokens generation stops at (EOS, a template's end of turn: ``stop_ids``); its
    content, the tokens before them, is repeated before them. The longer answer says the same, with no new
    information, in twice the tokens: no other model has to write it (a paraphrase would) and no filler text
    ties it to one tokenizer or language. Left out: a response with no content, and a pair whose longer
    answer and prompt would pass ``max_length`` tokens (``probe_room``: within the model's positions)."""
    pairs = []
    for example in examples:
        if len(pairs) == count:
            break
        best = example.response_ids[0]
        end = len(best)
        while end and best[end - 1] in stop_ids:
            end -= 1
        twice = best[:end] * 2 + best[end:]
        if end and (max_length is None or len(example.prompt_ids) + len(twice) <= max_length):
            pairs.append(RankingExample(example.prompt_ids, [twice, best]))
    return pairs


def probe_room(max_length: int | None, model) -> int | None:
    """The most tokens a length-probe pair may hold: ``data.max_length``, capped at the model's positions
    (``max_position_embeddings``): the answer said twice is longer than any row read, and max_length may be null."""
    context = getattr(unwrap_model(model).config.get_text_config(), "max_position_embeddings", None)
    limits = [n for n in (max_length, context) if n is not None]
    return min(limits) if limits else None


def length_probe(task: RMTask, scorer, pairs: list[RankingExample], micro: int, device) -> dict[str, float]:
    """What the reward model pays for length alone, on ``length_probe_pairs``' pairs (empty without one):
    ``length_probe/longer_preferred``, the share of pairs whose answer said twice scores above the same answer
    said once (a tie is not above); ``length_probe/score_per_token``, the mean of (r(twice) − r(once)) / the
    extra tokens; ``length_probe/pairs``. Saying an answer twice adds nothing: a length-neutral reward model
    prefers neither, a sound one the answer said once; one that prefers the longer in most pairs pays for
    length, and PPO against it runs its responses to the length limit (health alert 15)."""
    if not pairs:
        return {}
    scores = []
    scorer.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), micro):
            batch = task.collate(pairs[start : start + micro]).to(device)
            scores += task.scores(scorer, batch).float().cpu().tolist()
    twice, once = scores[0::2], scores[1::2]
    extra = [len(p.response_ids[0]) - len(p.response_ids[1]) for p in pairs]
    return {
        "length_probe/longer_preferred": sum(t > o for t, o in zip(twice, once, strict=True)) / len(pairs),
        "length_probe/score_per_token": sum((t - o) / n for t, o, n in zip(twice, once, extra, strict=True))
        / len(pairs),
        "length_probe/pairs": len(pairs),
    }


def report_length_probe(accelerator, output_dir, step: int, metrics: dict[str, float], where: str) -> None:
    """The length probe's one line, on the main process: a warning when the reward model prefers the longer
    answer (health alert 16, also written to ``alerts.jsonl``, where ``posttrain report`` shows it)."""
    if not metrics or not accelerator.is_main_process:
        return
    monitor = HealthMonitor(AlertConfig(), output_dir, "loss", "loss", echo=lambda _: None, rules=RM_RULES)
    alerts = monitor.check(step, metrics)
    if alerts:
        print(f"[rm] warning ({where} answers, alert 16): {alerts[0]['seen']}; RL against it will grow the length")
    else:
        print(f"[rm] length probe ({where} answers): {describe_length_probe(metrics)}")


@dataclass
class RMEvalConfig:
    """``posttrain eval`` of a reward model: its scores on held-out pairs or rankings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The reward model: a *ForSequenceClassification folder, a hub id, or a LoRA reward-model adapter."""
    data: DataConfig = field(default_factory=DataConfig)
    """Pairs {"prompt", "chosen", "rejected"} or rankings {"prompt", "responses": [best, ..., worst]}."""
    data_format: str = "auto"
    """pairs, rankings, or auto (pairs when the first row has 'chosen')."""
    margin: float = 0.0
    """The margin of the loss reported (as in training); 0 = plain Bradley–Terry."""
    center_coef: float = 0.0
    """The centering term of the loss reported (as in training); 0 = none."""
    batch_size: int = 16
    """Rankings scored per forward."""
    output_dir: str | None = None
    """Folder for eval_summary.json and eval_scores.jsonl (each ranking's responses, scores and lengths in
    tokens, EOS included); null = print only."""
    length_probe: int = 64
    """Score this many best responses once and said twice (``length_probe``, as ``posttrain rm`` does); 0 = off."""

    def validate(self) -> None:
        validate_sections(self)
        check_choice("data_format", self.data_format, DATA_FORMATS)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.length_probe < 0:
            raise ValueError(f"length_probe must be >= 0 (0 = off), got {self.length_probe}")
        if self.center_coef < 0:
            raise ValueError(f"center_coef must be >= 0, got {self.center_coef}")


def _length_bias(examples, starts: list[int], scores: list[float], lengths: list[int]) -> dict:
    """``length_corr``, ``pairs_tied`` and ``accuracy_better_longer`` / ``_shorter`` (with their pair counts) of
    the flat ``scores`` and ``lengths`` of every response; ``starts[k]``: the first response of ranking k."""
    metrics: dict[str, float] = {}
    if len(set(lengths)) > 1 and len(set(scores)) > 1:
        metrics["eval/length_corr"] = float(torch.corrcoef(torch.tensor([scores, lengths], dtype=torch.float64))[0, 1])
    by_length = {"longer": [0, 0], "shorter": [0, 0]}  # [pairs in order, pairs]
    tied = 0
    for example, first in zip(examples, starts, strict=False):
        for i, j in torch.stack(ranking_pairs(len(example.response_ids))).T.tolist():
            better, worse = first + i, first + j
            tied += scores[better] == scores[worse]
            if lengths[better] != lengths[worse]:
                kind = by_length["longer" if lengths[better] > lengths[worse] else "shorter"]
                kind[0] += scores[better] > scores[worse]
                kind[1] += 1
    metrics["eval/pairs_tied"] = tied
    for kind, (correct, pairs) in by_length.items():
        if pairs:
            metrics[f"eval/accuracy_better_{kind}"] = correct / pairs
            metrics[f"eval/pairs_better_{kind}"] = pairs
    return metrics


def evaluate(config: RMEvalConfig, log=print) -> dict:
    """Score every response of ``config.data`` with the reward model; the ``eval/`` metrics.

    As the trainer's held-out metrics, on the raw scores (before a ``reward_normalization`` the
    checkpoint holds, which the trainer's metrics precede too): ``loss`` (the ranking loss with
    ``margin`` and ``center_coef``, mean over rankings), ``accuracy`` (the share of ordered pairs scored
    in order; a tie counts as wrong, and ``pairs_tied`` says how many there were: half precision ties
    close scores),
    ``margin`` (mean r_better − r_worse), ``score_mean``, ``score_std``; with a normalisation also
    ``normalized_score_mean`` / ``_std``, the scores PPO reads. And the length bias a reward model learns
    from human labels (longer answers tend to be preferred): ``length_corr``, Pearson's r between a
    response's score and its length in tokens, and ``accuracy_better_longer`` /
    ``accuracy_better_shorter``, the accuracy over the pairs whose better response is the longer / the
    shorter one (each left out when no pair is of that kind). A model that ranks by length scores well
    only on the first. ``rows_read`` / ``rows_truncated`` / ``rows_dropped``: what the data limits did
    (the report is also ``log``ged). One process (``loop.evaluate_offline`` is the trainer's sharded one).
    A model in ``RUN/final/reward`` has its training run's config.yaml two folders up: the settings of
    it that change these numbers and differ here are ``log``ged, to pass for a like-for-like comparison.
    """
    config.validate()
    _compare_with_training_run(config, log)
    tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path)
    examples, report = load_ranking_data(config, tokenizer)
    log(f"[eval] data: {report.summary()}")
    model = load_reward_model(config.model)
    normalization = getattr(model.config, "reward_normalization", None)
    model.config.reward_normalization = None  # raw scores, as the trainer measured them
    scorer = RewardScorer(model)
    device = next(scorer.parameters()).device
    task = RMTask(tokenizer.pad_token_id, config.margin, config.center_coef)
    sums: dict[str, float] = {}
    scores: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(examples), config.batch_size):
            batch = task.collate(examples[start : start + config.batch_size]).to(device)
            batch_scores = task.scores(scorer, batch).float()
            for key, value in task.ranking_loss(batch_scores, batch.ks)[1].items():
                sums[key] = sums.get(key, 0.0) + float(value)
            scores += batch_scores.cpu().tolist()
    metrics = {f"eval/{k}": float(v) for k, v in task.finalize(sums, len(examples)).items()}
    if normalization:
        metrics["eval/normalized_score_mean"] = (metrics["eval/score_mean"] - normalization["mean"]) / normalization[
            "std"
        ]
        metrics["eval/normalized_score_std"] = metrics["eval/score_std"] / normalization["std"]
    metrics["eval/rankings"], metrics["eval/pairs"] = len(examples), int(sums["pairs"])
    metrics["eval/rows_read"], metrics["eval/rows_truncated"] = report.rows, report.truncated
    metrics["eval/rows_dropped"] = report.rows - report.kept
    lengths = [len(r) for e in examples for r in e.response_ids]
    starts = [0]
    for example in examples:
        starts.append(starts[-1] + len(example.response_ids))
    metrics.update(_length_bias(examples, starts, scores, lengths))
    room = probe_room(config.data.max_length, model)
    pairs = length_probe_pairs(examples, set(tokenizer.all_special_ids), config.length_probe, room)
    metrics.update({f"eval/{k}": v for k, v in length_probe(task, scorer, pairs, config.batch_size, device).items()})
    if length_preference(metrics):
        log(f"[eval] warning (alert 16): {length_preference(metrics)}")
    if config.output_dir:
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval_summary.json").write_text(json.dumps(metrics, indent=2))
        with open(out / "eval_scores.jsonl", "w") as f:
            for example, first, end in zip(examples, starts, starts[1:], strict=False):
                row = {
                    "prompt": tokenizer.decode(example.prompt_ids, skip_special_tokens=True),
                    "responses": [tokenizer.decode(r, skip_special_tokens=True) for r in example.response_ids],
                    "scores": scores[first:end],
                    "lengths": lengths[first:end],
                }
                f.write(json.dumps(row) + "\n")
    return metrics


# the training run's settings that change what ``evaluate`` reports: (its config.yaml key, this config's value)
_LIKE_FOR_LIKE = {
    "margin": lambda c: c.margin,
    "center_coef": lambda c: c.center_coef,
    "data.chat_template": lambda c: c.data.chat_template,
}


def _compare_with_training_run(config: RMEvalConfig, log) -> None:
    """Log the settings of the run that wrote ``RUN/final/reward`` (its ``RUN/config.yaml``) that differ
    from ``config``'s: its held-out ``eval/*`` used them."""
    import yaml

    from posttrain.runtime.checkpoint import flat_config

    model = Path(config.model.path)
    written = model.parent.parent / "config.yaml"
    if model.parent.name != "final" or not written.is_file():
        return
    trained = flat_config(yaml.safe_load(written.read_text()) or {})
    differing = [
        f"{key}={trained[key]!r} (here {value(config)!r})"
        for key, value in _LIKE_FOR_LIKE.items()
        if key in trained and trained[key] != value(config)
    ]
    if differing:
        log(
            f"[eval] the run that trained {model} used {', '.join(differing)} ({written}); pass them as key=value "
            "to compare with its eval/* metrics"
        )

"""Training passes: reward-model rankings of mixed K scored at once equal one at a time; the fused optimizer."""

import torch
from helpers import assert_close

from posttrain.core import ranking_loss
from posttrain.data import RankingExample
from posttrain.models import ModelConfig, RewardScorer, load_scalar_model, sequence_scores
from posttrain.trainers.rm import RMTask


def test_rankings_of_mixed_k_scored_at_once_equal_one_at_a_time(tiny_dir, tokenizer):
    model = load_scalar_model(ModelConfig(path=str(tiny_dir / "reward"), device="cpu"), "reward")
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    examples = [
        RankingExample(ids("1+1="), [ids("2"), ids("3"), ids("11")]),
        RankingExample(ids("2+2="), [ids("4"), ids("5")]),
        RankingExample(ids("3+3="), [ids("6"), ids("7"), ids("8")]),
        RankingExample(ids("4+4="), [ids("8"), ids("9")]),
    ]
    task = RMTask(tokenizer.pad_token_id, margin=0.5, center_coef=0.1)
    batch = task.collate(examples)
    loss_sum, sums = task.loss(RewardScorer(model), batch)  # the module RM training runs through

    with torch.no_grad():
        scores = sequence_scores(model, batch.sequences.input_ids, batch.sequences.attention_mask)
    expected, correct = 0.0, 0
    for ranking in torch.split(scores, batch.ks):
        better, worse = torch.triu_indices(len(ranking), len(ranking), offset=1)
        expected += ranking_loss(ranking[None], margin=0.5) + 0.1 * (ranking[better] + ranking[worse]).square().mean()
        correct += int((ranking[better] > ranking[worse]).sum())
    assert_close(loss_sum.detach(), expected)
    assert sums["pairs"] == 3 + 1 + 3 + 1 and sums["responses"] == 10 and sums["correct"] == correct
    assert_close(sums["score"], scores.sum())
    loss_sum.backward()  # one graph through the single forward
    assert model.score.weight.grad is not None


def test_optimizer_is_the_fused_adamw_on_cpu():
    from posttrain.runtime.config import OptimConfig
    from posttrain.runtime.loop import build_optimizer

    model = torch.nn.Linear(4, 2)
    optimizer, _ = build_optimizer(model.parameters(), OptimConfig(lr=1e-3), total_steps=10)
    assert optimizer.defaults["fused"] is True
    model(torch.ones(1, 4)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.weight)

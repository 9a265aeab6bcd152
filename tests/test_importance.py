"""Masked importance sampling (``core.masked_importance_weights``): IcePop's token band and MIS's sequence
band, against values worked by hand. Truncated IS (TIS) is in test_rollout_seam.py."""

import math

import pytest
import torch
from helpers import assert_close

from posttrain.core import masked_importance_weights

NAN = float("nan")


def test_token_band_keeps_the_ratio_inside_and_drops_the_token_outside():
    # log-ratios old − behaviour: 0.5, 0, −1, 1.0 → ρ = 1.649, 1, 0.368, 2.718; band [0.5, 2]
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    behaviour = torch.tensor([[-0.5, -1.0, -1.0, -1.0]])
    weights, keep = masked_importance_weights(old, behaviour, torch.ones(1, 4), "token", 0.5, 2.0)
    assert keep.tolist() == [[True, True, False, False]]
    assert_close(weights, [[math.exp(0.5), 1.0, 0.0, 0.0]])


def test_sequence_band_keeps_or_drops_whole_rows():
    # row 0: Σ log-ratio = 0.5 − 0.3 = 0.2 → ρ = 1.221, kept; row 1: 0.9 → 2.46 > 2, dropped;
    # row 2: −0.8 → 0.449 < 0.5, dropped; padding (mask 0) holds NaN and changes nothing
    old = torch.tensor([[0.0, -1.3, NAN], [0.0, 0.0, 0.0], [-0.8, 0.0, 0.0]])
    behaviour = torch.tensor([[-0.5, -1.0, 0.0], [-0.4, -0.5, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    weights, keep = masked_importance_weights(old, behaviour, mask, "sequence", 0.5, 2.0)
    assert keep.tolist() == [[True, True, False], [False] * 3, [False] * 3]
    assert_close(weights, [[math.exp(0.2), math.exp(0.2), 1.0], [0.0] * 3, [0.0] * 3])


def test_a_zero_low_bound_keeps_every_small_ratio_and_long_rows_do_not_overflow():
    old, behaviour = torch.zeros(2, 4096), torch.full((2, 4096), 1.0)
    behaviour[1] = -1.0  # row 1: Σ = 4096, exp would overflow float32 were it taken
    weights, keep = masked_importance_weights(old, behaviour, torch.ones(2, 4096), "sequence", 0.0, 2.0)
    assert keep[0].all() and not keep[1].any()
    assert torch.isfinite(weights).all() and float(weights[0, 0]) == 0.0  # exp(−4096) underflows to 0


def test_the_weights_carry_no_gradient():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights, _ = masked_importance_weights(old, torch.tensor([[-1.1, -2.0]]), torch.ones(1, 2), "token")
    assert not weights.requires_grad


@pytest.mark.parametrize(("low", "high"), [(1.5, 2.0), (0.5, 0.9), (-0.1, 2.0)])
def test_a_band_without_one_is_refused(low, high):
    with pytest.raises(ValueError, match="band must hold 1"):
        masked_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "token", low, high)

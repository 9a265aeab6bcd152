"""Property tests: posttrain.core against naive Python loops over random shapes and masks (empty rows too)."""

import statistics

import torch
from helpers import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.core import aggregate_loss, gae, group_advantages, masked_mean, rloo_advantages

floats = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def masked_batch(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    x = draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=b, max_size=b))
    y = draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=b, max_size=b))
    mask = [[1 if j < n else 0 for j in range(t)] for n in lengths]
    return torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64), torch.tensor(mask), lengths


def naive_gae(rewards, values, lengths, gamma, lam):
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        running = 0.0
        for t in reversed(range(n)):
            next_v = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    ret = [[adv[b][t] + values[b][t] if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)]
    return adv, ret


@settings(max_examples=60, deadline=None)
@given(masked_batch(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_naive_loop(batch, gamma, lam):
    r, v, mask, lengths = batch
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = naive_gae(r.tolist(), v.tolist(), lengths, gamma, lam)
    assert_close(adv, ref_adv, rtol=1e-9, atol=1e-9)
    assert_close(ret, ref_ret, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(masked_batch())
def test_aggregations_match_naive_loops(batch):
    x, _, mask, lengths = batch
    rows = x.tolist()
    B, T = x.shape
    valid = [[rows[b][t] for t in range(lengths[b])] for b in range(B)]
    nonempty = [v for v in valid if v]
    n_tok = sum(len(v) for v in valid)
    expected = {
        "token-mean": sum(map(sum, valid)) / max(n_tok, 1),
        "seq-mean-token-mean": sum(sum(v) / len(v) for v in nonempty) / max(len(nonempty), 1),
        "seq-mean-token-sum": sum(sum(v) for v in nonempty) / max(len(nonempty), 1),
        "seq-mean-token-sum-norm": sum(map(sum, valid)) / (B * T),
    }
    for mode, value in expected.items():
        assert_close(aggregate_loss(x, mask, mode), value, rtol=1e-9, atol=1e-9)
    assert_close(masked_mean(x, mask), expected["token-mean"], rtol=1e-9, atol=1e-9)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(2, 6), st.data())
def test_group_advantages_match_naive_and_stay_bounded(n_prompts, group_size, data):
    values = data.draw(
        st.lists(
            st.sampled_from([0.0, 0.1, 1.0, 0.3333]) | floats,
            min_size=n_prompts * group_size,
            max_size=n_prompts * group_size,
        )
    )
    rewards = torch.tensor(values, dtype=torch.float64)
    adv = {s: group_advantages(rewards, group_size, scale=s) for s in ("group", "batch", "none")}
    loo = rloo_advantages(rewards, group_size)
    std_all = statistics.stdev(values)
    for p in range(n_prompts):
        group = values[p * group_size : (p + 1) * group_size]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        for i, r in enumerate(group):
            k = p * group_size + i
            if len(set(group)) == 1:
                for a in (*adv.values(), loo):
                    assert a[k].item() == 0.0
                continue
            assert_close(adv["none"][k], r - mean, rtol=1e-9, atol=1e-9)
            assert_close(adv["group"][k], (r - mean) / (std + 1e-4), rtol=1e-7, atol=1e-9)
            assert_close(adv["batch"][k], (r - mean) / (std_all + 1e-4), rtol=1e-7, atol=1e-9)
            others = (sum(group) - r) / (group_size - 1)
            assert_close(loo[k], r - others, rtol=1e-9, atol=1e-9)
    # |A| ≤ (G − 1)/√G for std scaling: finite and bounded, never the 7428 of docs/pitfalls.md #9
    bound = (group_size - 1) / group_size**0.5 + 1e-6
    assert adv["group"].abs().max().item() <= bound

"""Token rewards and advantage estimators: RLHF-PPO reward shaping, GAE (with VC-PPO's decoupled λ and VAPO's
length-adaptive λ), GRPO group advantages, RLOO."""

from __future__ import annotations

import torch

from posttrain.core.masks import last_valid_index, zero_masked


def shape_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float | torch.Tensor
) -> torch.Tensor:
    """RLHF-PPO token rewards (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2):

        r_t = −kl_coef · kl_t  at every valid token,  plus  score  at the last valid token.

    scores: [B] sequence-level reward (e.g. the reward model's score of prompt+response).
    kl: [B, T] per-token KL estimate (``kl_penalty``); mask: [B, T], 1 = response token.
    Returns [B, T], 0 at masked positions; a row without valid tokens gets no score.
    """
    mask = mask.bool()
    rewards = zero_masked(-kl_coef * zero_masked(kl, mask), mask)
    last = last_valid_index(mask)
    has_token = last >= 0
    score_at_end = torch.zeros_like(rewards).scatter(
        1, last.clamp(min=0).unsqueeze(1), torch.where(has_token, scores.to(rewards.dtype), 0.0).unsqueeze(1)
    )
    return rewards + score_at_end


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16) over the valid tokens of each row:

        δ_t = r_t + γ·V_{t'} − V_t,      A_t = δ_t + γλ_b·A_{t'},      returns_t = A_t + V_t

    where t' is the next valid token after t, and V_{t'} = A_{t'} = 0 after the last one: the response
    ends there, so nothing is bootstrapped from padding (docs/pitfalls.md #12). Masked tokens inside a row
    (an episode's environment tokens) are skipped, not ends: the state at the model's next turn follows its
    last one, the environment's answer being part of that state (docs/algorithms/multi_turn.md).

    rewards, values: [B, T]; mask: [B, T], 1 = a token the policy sampled.
    lam: one λ for every row, or [B]: λ_b of row b (VAPO's length-adaptive λ, ``length_adaptive_lam``).
    Returns (advantages [B, T], returns [B, T]), both 0 at masked positions.
    """
    mask = mask.bool()
    rewards, values = zero_masked(rewards, mask), zero_masked(values, mask)
    if isinstance(lam, torch.Tensor):
        if lam.shape != rewards.shape[:1]:
            raise ValueError(f"lam must be a number or one λ per row [B={rewards.shape[0]}], got {tuple(lam.shape)}")
        lam = lam.to(device=rewards.device, dtype=rewards.dtype)
    T = rewards.shape[-1]
    advantages_reversed = []
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        advantages_reversed.append(torch.where(mask[:, t], advantage, 0.0))
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = zero_masked(advantages + values, mask)
    return advantages, returns


def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam_actor: float | torch.Tensor,
    lam_critic: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (VC-PPO, Yuan et al. 2025, arXiv 2503.01491, "Decoupled-GAE"; kept by VAPO, Yue et al.
    2025, arXiv 2504.05118, §3.1): the policy's advantages and the critic's returns from two λ's,

        advantages = A^{GAE(γ, λ_actor)},      returns = A^{GAE(γ, λ_critic)} + V

    With γ = λ_critic = 1 the returns are the reward-to-go Σ_{t''≥t} r_{t''} whatever V is (the Monte-Carlo
    return, VC-PPO's choice for the critic: the end-of-response score reaches every token undecayed), while
    λ_actor < 1 keeps the advantages' variance down. ``gae`` computes both, shapes and masks as there;
    lam_actor may be [B] (``length_adaptive_lam``). Returns (advantages [B, T], returns [B, T]).
    """
    advantages, returns = gae(rewards, values, mask, gamma, lam_actor)
    if isinstance(lam_actor, torch.Tensor) or lam_actor != lam_critic:
        returns = gae(rewards, values, mask, gamma, lam_critic)[1]
    return advantages, returns


def length_adaptive_lam(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive λ of the policy (Yue et al. 2025, arXiv 2504.05118, §3.2, "Length-Adaptive GAE"):
    the TD errors' total weight Σ_t λ^t = 1/(1 − λ) is set to α·l, proportional to the response's length l,

        λ_policy = 1 − 1/(α·l),      clamped to [0, 1)

    so that a long response's end reward still reaches its early tokens and a short one keeps a low variance.
    The clamp is ours: for α·l ≤ 1 (l ≤ 20 tokens at VAPO's α = 0.05) the formula gives λ ≤ 0, and GAE with a
    negative λ would flip the sign of later TD errors; λ = 0 there is TD(0), the formula's own limit at α·l = 1.

    lengths: [B], the tokens each response sampled (0 for none: λ = 0, which no token uses). Returns [B] float.
    """
    return (1.0 - 1.0 / (alpha * lengths.double())).clamp(min=0.0).to(torch.get_default_dtype())


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [B] → [P, G], B = P·G consecutive groups; checks the sizes."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to compare responses within a group, got {group_size}")
    if rewards.dim() != 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"rewards must be [B] with B divisible by group_size={group_size}, got {tuple(rewards.shape)}")
    return rewards.view(-1, group_size)


def _scored(grouped: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scored [P, G] bool, rewards with 0 where unscored [P, G], scored count per group [P, 1])."""
    scored = torch.ones_like(grouped, dtype=torch.bool) if mask is None else mask.view_as(grouped).bool()
    return scored, torch.where(scored, grouped, 0.0), scored.sum(dim=1, keepdim=True)


class NonFiniteGroupError(ValueError):
    """Finite rewards whose magnitude makes their group's statistics (mean, std, leave-one-out mean) non-finite
    even in float64. ``row``: the index in ``rewards`` of the group's largest scored reward."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def _check_statistics(grouped: torch.Tensor, scored: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
    """Raise NonFiniteGroupError for the first group whose scored rewards are all finite but one of ``stats``
    ([P, 1] or [P, G] float64, or a scalar for the whole batch) is not: its advantages would silently be 0
    (x / inf) or NaN. A group holding a non-finite reward is the caller's to refuse; it is not judged here."""
    finite_inputs = torch.where(scored, grouped, 0.0).isfinite().all(dim=1, keepdim=True)  # [P, 1]
    G = grouped.shape[1]
    for name, value in stats.items():
        bad = finite_inputs & scored & ~value.expand_as(grouped).isfinite()  # [P, G]
        if not bool(bad.any()):
            continue
        within = bad  # a batch statistic: the batch's largest reward
        if value.dim():  # a group's: the first such group's largest reward
            first = int(bad.any(dim=1).nonzero()[0])
            within = torch.zeros_like(scored)
            within[first] = scored[first]
        row = int(torch.where(within, grouped.abs(), -1.0).reshape(-1).argmax())
        g = row // G
        raise NonFiniteGroupError(
            f"reward {float(grouped.reshape(-1)[row]):g} (row {row}) makes the {name} of "
            f"{'the batch' if value.dim() == 0 else f'its group (rows {g * G}-{g * G + G - 1})'} non-finite even in "
            "float64; rewards must stay well within ±1e150 to be compared",
            row,
        )


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()


def _zero_constant_groups(grouped: torch.Tensor, centered: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Exactly 0 for a group whose scored rows are all equal (or fewer than two), and for unscored rows:
    r − mean can leave a float residue that a std-division turns into huge advantages (docs/pitfalls.md #9)."""
    high = torch.where(scored, grouped, -torch.inf).amax(dim=1, keepdim=True)
    low = torch.where(scored, grouped, torch.inf).amin(dim=1, keepdim=True)
    flat = (high <= low) | (scored.sum(dim=1, keepdim=True) < 2)
    return torch.where(flat | ~scored, 0.0, centered)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-4,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath §4.1.2):

        group:  A_i = (r_i − mean_g) / (std_g + eps)
        batch:  A_i = (r_i − mean_g) / (std_all + eps)   (std over the whole batch, as in REINFORCE++/TRL)
        none:   A_i =  r_i − mean_g                       (Dr. GRPO, Liu et al. 2025: no std scaling)

    rewards: [B] in consecutive groups of ``group_size`` responses to one prompt (B = P·G).
    mask: [B], 1 = scored; mean and std are taken over a group's scored rows only and an unscored row
    (a reward function returned None) gets 0: filling it in would shrink the std. Default: all scored.
    std uses Bessel's correction. A constant group, or one with fewer than two scored rows, gives
    exactly 0. Returns [B] in the dtype of ``rewards``.

    The statistics are computed in float64, as PPO's whitening (``runtime.online.gather_whiten``): in
    float32 the rewards 0 and 1e30 of one group square to inf, std = inf and every advantage silently
    became 0. Finite float64 rewards whose statistics overflow even float64 (|r| ≳ 1e154) raise
    ``NonFiniteGroupError`` naming the row, instead of training on advantages of 0 or NaN (float32 rewards
    cannot: they are checked only in float64, which also spares every float32 call a host sync).
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be one of ('group', 'batch', 'none'), got {scale!r}")
    grouped = _grouped(rewards, group_size).double()
    scored, values, n = _scored(grouped, mask)
    mean = values.sum(dim=1, keepdim=True) / n.clamp(min=1)
    deviation = torch.where(scored, grouped - mean, 0.0)
    centered = _zero_constant_groups(grouped, deviation, scored)
    stats = {"mean": mean}
    if scale == "group":
        std = (deviation.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        stats["std"] = std
        centered = centered / (std + eps)
    elif scale == "batch":
        std = grouped.reshape(-1)[scored.reshape(-1)].std()
        stats["std"] = std
        centered = centered / (std + eps)
    if rewards.dtype == torch.float64:  # float32 rewards (|r| < 3.4e38) cannot overflow float64 statistics
        _check_statistics(grouped, scored, stats)
    return centered.reshape(-1).to(_out_dtype(rewards))


def rloo_advantages(rewards: torch.Tensor, group_size: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024):

        A_i = r_i − (Σ_{j≠i} r_j) / (G − 1)

    rewards: [B] in consecutive groups of ``group_size``. mask: [B], 1 = scored: the baseline averages
    the other *scored* rows of the group (n − 1 of them) and an unscored row gets 0. A constant group,
    or one with fewer than two scored rows, gives exactly 0. Returns [B] in the dtype of ``rewards``;
    computed in float64, non-finite statistics raise ``NonFiniteGroupError`` (``group_advantages``).
    """
    grouped = _grouped(rewards, group_size).double()
    scored, values, n = _scored(grouped, mask)
    others_mean = (values.sum(dim=1, keepdim=True) - values) / (n - 1).clamp(min=1)
    if rewards.dtype == torch.float64:  # float32 rewards cannot overflow float64 statistics: no host sync then
        _check_statistics(grouped, scored, {"leave-one-out mean": others_mean})
    return _zero_constant_groups(grouped, grouped - others_mean, scored).reshape(-1).to(_out_dtype(rewards))

"""PPO's critic as one of two objects with one interface, chosen once at construction (``build_critic``):

- ``SeparateCritic``: its own model V_φ (initialised from the reward model or the policy), its own
  optimizer and learning rate, stepped on the clipped value loss after each policy step;
- ``SharedValueHead``: a value head on the policy's backbone, one forward for log-probs and values,
  one loss (policy loss + vf_coef · value loss) and one optimizer.

Interface: ``policy_forward`` (the policy's training forward: log-probs, values or None, entropy),
``values`` (V(s_t) of rollout rows, for GAE), ``joint_loss`` (what the critic adds to the policy's
loss), ``step`` (its own optimizer step on a minibatch: its updates for ``StepStats`` and its numbers),
``pretrain_step`` (a step of VC-PPO's value pretraining, the policy untouched), ``models_to_save`` and
``nonfinite_skips``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from posttrain.core import aggregate_loss, value_loss
from posttrain.errors import UserError
from posttrain.models import PolicyWithValueHead, ValueModel, load_critic
from posttrain.rollout import Rollout
from posttrain.runtime import engines
from posttrain.runtime.loop import NonFiniteGuard, build_optimizer, global_sums
from posttrain.runtime.online import policy_logprobs
from posttrain.runtime.update import MinibatchUpdate, Optimized


@dataclass
class PPOBatch:
    """The rows of a rollout a PPO minibatch trains on, with what the rollout computed for them
    (all [b, T] over response tokens; ``mask`` is the response mask)."""

    rollout: Rollout
    mask: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor


def value_objective(config, values, batch: PPOBatch, s: slice) -> tuple[torch.Tensor, dict]:
    """(clipped value loss of ``values`` [b, T] on rows ``s`` of ``batch``, reduced by ``loss_agg``;
    {value_loss, value_clipfrac})."""
    mask = batch.mask[s]
    per_token, stats = value_loss(values, batch.old_values[s], batch.returns[s], mask, clip_range=config.vf_clip)
    loss = aggregate_loss(per_token, mask, config.loss_agg, config.sampling.max_new_tokens)
    return loss, {"value_loss": loss.detach(), **stats}


class SeparateCritic:
    """V_φ(s_t) from a model of its own, trained on the clipped value loss by its own optimizer."""

    def __init__(self, accelerator, config, actor_model, trained: Optimized):
        self.accelerator, self.config, self.actor_model, self.trained = accelerator, config, actor_model, trained

    @property
    def model(self) -> torch.nn.Module:
        return self.trained.model

    def policy_forward(self, rollout: Rollout, rows: slice, with_entropy=False, entropy_grad=False):
        """(log-probs [b, T], None, entropy [b, T] or None) of the policy on ``rows``."""
        logprobs, entropy = policy_logprobs(
            self.actor_model, rollout, rows, self.accelerator.device, with_entropy, entropy_grad
        )
        return logprobs, None, entropy

    def values(self, rollout: Rollout, rows: slice) -> torch.Tensor:
        device = self.accelerator.device
        return self.model(
            rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device), rollout.response_length
        )

    def joint_loss(self, values, batch: PPOBatch, s: slice) -> tuple[float, dict]:
        """Nothing: the separate critic has a loss and an optimizer step of its own."""
        return 0.0, {}

    def step(self, step: int, batch: PPOBatch) -> tuple[tuple[MinibatchUpdate, ...], dict[str, float]]:
        """One optimizer step of the critic on the minibatch, after the policy's: under fp16 each
        optimizer's gradients are scaled, unscaled and stepped within one cycle of accelerate's shared
        GradScaler. Returns (its update, whose value stats ``StepStats`` reduces; {critic_grad_norm})."""
        update = MinibatchUpdate(
            self.accelerator, self.trained, batch.mask, self.config.loss_agg, self.config.run.micro_batch_size
        )
        for micro in update:  # gradients synchronised on the last micro-batch only
            values = self.values(batch.rollout, micro.rows)
            loss, stats = value_objective(self.config, values, batch, micro.rows)
            update.backward(micro, loss, stats)
        return (update,), {"critic_grad_norm": update.step(step)}

    def pretrain_step(self, step: int, batch: PPOBatch) -> tuple[tuple[MinibatchUpdate, ...], dict[str, float]]:
        """Value pretraining: the critic's own step, as during PPO (its optimizer and schedule go on from there)."""
        return self.step(step, batch)

    def models_to_save(self) -> dict[str, torch.nn.Module]:
        return {"critic": self.model}

    def nonfinite_skips(self) -> int:
        return self.trained.guard.skips


class SharedValueHead:
    """V(s_t) from a value head on the policy's last hidden state (``PolicyWithValueHead``): the policy's
    forward gives the values, the value loss joins the policy loss with weight ``vf_coef``."""

    def __init__(self, accelerator, config, actor_model):
        self.accelerator, self.config, self.actor_model = accelerator, config, actor_model
        self.head = None  # the value head alone, with an optimizer of its own, for value pretraining
        if config.value_pretrain_steps:
            if engines.is_deepspeed(accelerator) or engines.is_fsdp(accelerator):
                raise UserError(
                    "value_pretrain_steps with critic=shared trains the value head alone, outside the engine's "
                    "wrapper, and DeepSpeed / FSDP2 shard it: use critic=reward or critic=policy, or DDP"
                )
            head = accelerator.unwrap_model(actor_model).v_head
            optim = replace(config.optim, lr=config.critic_lr or 10 * config.optim.lr, scheduler="constant")
            optimizer, _ = build_optimizer(head.parameters(), optim, config.value_pretrain_steps)
            self.head = Optimized(head, optimizer, None, NonFiniteGuard(accelerator, config.run, "value_head"), None)

    def policy_forward(self, rollout: Rollout, rows: slice, with_entropy=False, entropy_grad=False):
        """(log-probs [b, T], values [b, T], entropy [b, T] or None) of ``rows`` from one forward."""
        device = self.accelerator.device
        return self.actor_model(
            rollout.input_ids[rows].to(device),
            rollout.attention_mask[rows].to(device),
            rollout.response_length,
            rollout.temperature,
            with_entropy,
            entropy_grad,
        )

    def values(self, rollout: Rollout, rows: slice) -> torch.Tensor:
        return self.policy_forward(rollout, rows)[1]

    def joint_loss(self, values, batch: PPOBatch, s: slice) -> tuple[torch.Tensor, dict]:
        """vf_coef · clipped value loss, added to the policy's loss."""
        loss, stats = value_objective(self.config, values, batch, s)
        return self.config.vf_coef * loss, stats

    def step(self, step: int, batch: PPOBatch) -> tuple[tuple, dict[str, float]]:
        return (), {}  # stepped with the policy

    def pretrain_step(self, step: int, batch: PPOBatch) -> tuple[tuple[MinibatchUpdate, ...], dict[str, float]]:
        """Value pretraining of the head alone: the backbone is the policy, which stays frozen, so the head
        fits the clipped value loss on the backbone's detached last hidden states, stepped by an AdamW of its
        own (lr critic_lr, null = 10 × optim.lr); PPO's one optimizer then starts from the pretrained head."""
        cfg, model = self.config, self.accelerator.unwrap_model(self.actor_model)
        update = MinibatchUpdate(self.accelerator, self.head, batch.mask, cfg.loss_agg, cfg.run.micro_batch_size)
        rollout, device = batch.rollout, self.accelerator.device
        for micro in update:
            # under accelerate's autocast, as the wrapped forward PPO reads values from: the head fits those values
            with self.accelerator.autocast():
                with torch.no_grad():
                    ids, attention = rollout.input_ids[micro.rows], rollout.attention_mask[micro.rows]
                    out = model.backbone(ids.to(device), attention.to(device))
                values = model.head_values(out.hidden_states[-1][:, -rollout.response_length - 1 : -1])
            loss, stats = value_objective(cfg, values, batch, micro.rows)
            update.backward(micro, loss, stats)
        return (update,), {"critic_grad_norm": self._step_head(update, step)}

    def _step_head(self, update: MinibatchUpdate, step: int) -> float:
        """Clip and step the head (``loop.optimizer_step``'s order, with its non-finite guard); under several
        processes its gradient is averaged here, as DDP does for the parameters it wraps."""
        acc, head = self.accelerator, self.head
        if update.empty:
            return math.nan
        params = list(head.model.parameters())
        if acc.num_processes > 1:
            for p in params:
                p.grad = acc.reduce(p.grad, reduction="mean")
        norm = engines.grad_norm(acc, params, self.config.optim.max_grad_norm)
        (loss,) = global_sums(acc, update.loss)
        if head.guard.allows(step + 1, loss=loss / acc.num_processes, grad_norm=norm):
            head.optimizer.step()
        head.optimizer.zero_grad(set_to_none=True)
        return norm

    def models_to_save(self) -> dict[str, torch.nn.Module]:
        return {}  # the head is saved with the policy (value_head.safetensors)

    def nonfinite_skips(self) -> int:
        return 0


def build_critic(accelerator, config, policy, updates: int) -> tuple[Optimized, SeparateCritic | SharedValueHead]:
    """(the trained policy — with a value head when ``config.critic == "shared"`` — prepared by accelerate
    with its optimizer, the critic). ``updates``: optimizer steps of the run, for the schedules."""
    if config.critic == "shared":
        actor = _prepared(accelerator, PolicyWithValueHead(policy), config.optim, updates, config.run)
        return actor, SharedValueHead(accelerator, config, actor.model)
    # the critic is trained: model.gradient_checkpointing applies to it whichever weights it starts from
    checkpointing = config.model.gradient_checkpointing
    critic = ValueModel(  # trained through its forward: DDP synchronises its gradients
        load_critic(
            config.critic,
            replace(config.model, device="cpu", lora=None),
            None
            if config.reward_model is None
            else replace(config.reward_model, device="cpu", gradient_checkpointing=checkpointing),
        )
    )
    actor = _prepared(accelerator, policy, config.optim, updates, config.run)
    critic_optim = replace(config.optim, lr=config.critic_lr or 10 * config.optim.lr)
    # value pretraining steps the critic before PPO does: its schedule spans both
    pretraining = config.value_pretrain_steps * config.ppo_epochs * config.minibatches
    trained = _prepared(accelerator, critic, critic_optim, updates + pretraining, config.run, "critic")
    return actor, SeparateCritic(accelerator, config, actor.model, trained)


def _prepared(accelerator, model, optim, updates: int, run, name: str = "policy") -> Optimized:
    optimizer, scheduler = build_optimizer([p for p in model.parameters() if p.requires_grad], optim, updates)
    model, optimizer = engines.prepare(accelerator, model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return Optimized(model, optimizer, scheduler, NonFiniteGuard(accelerator, run, model=name), optim.max_grad_norm)

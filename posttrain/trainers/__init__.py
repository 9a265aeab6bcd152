"""The algorithms: each module holds one trainer's config dataclass and its ``train(config)``; what they
share is in ``posttrain.runtime``.

``TRAINERS``: the CLI's command → (module, config class, one line); ``posttrain export`` reads it too, to
name the trainer of a saved config."""

TRAINERS = {
    "sft": ("posttrain.trainers.sft", "SFTConfig", "supervised fine-tuning on completion tokens"),
    "rm": ("posttrain.trainers.rm", "RMConfig", "reward model from preference pairs or K-way rankings"),
    "prm": ("posttrain.trainers.prm", "PRMConfig", "process reward model from step-labelled solutions"),
    "dpo": ("posttrain.trainers.dpo", "DPOConfig", "direct preference optimization (and SimPO, ORPO)"),
    "kto": ("posttrain.trainers.kto", "KTOConfig", "KTO on unpaired desirable / undesirable completions"),
    "ppo": ("posttrain.trainers.ppo", "PPOConfig", "RLHF-PPO: policy, reference, reward model and critic"),
    "grpo": ("posttrain.trainers.grpo", "GRPOConfig", "GRPO and its variants (DAPO, Dr. GRPO, RLOO, REINFORCE++)"),
    "online-dpo": (
        "posttrain.trainers.online_dpo",
        "OnlineDPOConfig",
        "online DPO: pairs the policy samples, ranked by rewards, a reward model or a judge",
    ),
    "distill": (
        "posttrain.trainers.distill",
        "DistillConfig",
        "on-policy distillation from a frozen teacher (reverse KL, GKD's generalized JSD)",
    ),
}

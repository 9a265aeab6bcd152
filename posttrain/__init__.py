"""posttrain: post-training for language models (SFT, reward models, DPO, RLHF-PPO, GRPO).

Importing the package is cheap: ``posttrain.core`` needs torch only, and the heavier layers
(``models``, ``data``, ``rollout``, ``trainers``) are imported by name when used.
"""

__version__ = "0.1.0"

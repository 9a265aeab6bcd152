"""posttrain: post-training for language models (SFT, reward models, DPO, RLHF-PPO, GRPO).

Importing the package is cheap: ``posttrain.core`` needs torch only, and the heavier layers
(``models``, ``data``, ``rollout``, ``trainers``) are imported by name when used.
"""

# The one place the version is written: pyproject.toml reads it from here; semantic versioning, each
# release in CHANGELOG.md.
__version__ = "0.2.0"

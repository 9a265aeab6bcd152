"""The runtime every trainer shares: the online loop, the offline loop, the training engines (DDP, FSDP2,
DeepSpeed), checkpoints, start-time checks, shared-prefix packing, metrics, configs, weight names, stop
signals and the run lock. It imports the layers below it (core, models, data, rewards, rollout, monitor),
never an algorithm in ``posttrain.trainers``."""

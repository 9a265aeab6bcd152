"""The demo's RM → PPO pipeline with and without a critic that keeps up (issue 38 item 3, docs/algorithms/ppo.md):
value pretraining and decoupled λ (VC-PPO), then VAPO's length-adaptive λ on top.

    nice -n 5 .venv/bin/python bench/critic_curves.py --seeds 0 1 2 --steps 30

Per seed, the demo's stages 1 and 5 (``posttrain.demo``: the tiny Llama built from the seed, and a reward model
trained on 4-way vowel rankings from it), then its stage 6 (PPO of the tiny model against that reward model, the
critic initialised from it: 32 responses of exactly 8 tokens per step, lr 1e-3, β 0.05, λ 0.95) once per
setting (``SETTINGS``). Prints one JSON line per run and a summary: value loss and explained variance over the
first and last ``--window`` PPO steps, the critic_pretrain/* numbers of the first and last pretraining step, and
the score (the reward model's, the demo's "final score") over the first and last window; mean and min–max over
seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from posttrain.demo import PPO_SETTINGS

SETTINGS = {
    "plain": [],
    "vc-ppo": ["value_pretrain_steps=5", "critic_lam=1.0"],
    "vc-ppo+vapo-lam": ["value_pretrain_steps=5", "critic_lam=1.0", "length_adaptive_alpha=0.05"],
    "vc-ppo+lam-alpha0.5": ["value_pretrain_steps=5", "critic_lam=1.0", "length_adaptive_alpha=0.5"],
}


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def _pipeline(out: Path, seed: int) -> tuple[str, str, list[str]]:
    """The demo's tiny policy and reward model for ``seed`` (stages 1 and 5), and the PPO prompts file."""
    from posttrain.data.synthetic import vowel_rankings
    from posttrain.demo import STEPS, _write
    from posttrain.models.tiny import build_tiny
    from posttrain.runtime.config import load_config
    from posttrain.trainers import rm

    common = ["run.progress=null", "data.chat_template=never", f"run.seed={seed}", "run.overwrite=true"]
    policy = str(build_tiny(out / "tiny" / "policy", seed=seed))
    rankings = _write(out / "data" / "rankings.jsonl", vowel_rankings(800, k=4, seed=seed))
    rm.train(
        load_config(
            rm.RMConfig,
            None,
            common
            + [f"model.path={policy}", f"data.path={rankings}", f"run.output_dir={out / 'rm'}"]
            + [f"run.max_steps={STEPS['rm']}", "run.batch_size=16", "optim.lr=2e-3", "optim.scheduler=constant"]
            + ["data.eval_fraction=0.1", "data_format=rankings"],
        )
    )
    prompts = _write(out / "data" / "ppo_prompts.jsonl", [{"prompt": "rank:"}] * 64)
    base = [f"model.path={policy}", f"reward_model.path={out / 'rm' / 'final' / 'reward'}", f"data.path={prompts}"]
    return policy, prompts, common + base + PPO_SETTINGS


def _ppo(out: Path, base: list[str], name: str, steps: int, window: int) -> dict:
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers import ppo

    run = out / name
    overrides = [*base, *SETTINGS[name], f"run.output_dir={run}", f"run.max_steps={steps}"]
    ppo.train(load_config(ppo.PPOConfig, None, overrides))
    records = read_metrics(run)
    pretraining = [r for r in records if "critic_pretrain/step" in r]
    steps_ = [r for r in records if r["step"] > 0]
    result = {
        "value_loss_first": _mean(steps_[:window], "value_loss"),
        "value_loss_last": _mean(steps_[-window:], "value_loss"),
        "explained_variance_first": _mean(steps_[:window], "values/explained_variance"),
        "explained_variance_last": _mean(steps_[-window:], "values/explained_variance"),
        "score_first": _mean(steps_[:window], "score/mean"),
        "score_last": _mean(steps_[-window:], "score/mean"),
        "kl_last": _mean(steps_[-window:], "kl/per_sequence"),
    }
    if pretraining:
        result |= {
            "pretrain_value_loss_first": pretraining[0]["critic_pretrain/value_loss"],
            "pretrain_value_loss_last": pretraining[-1]["critic_pretrain/value_loss"],
            "pretrain_explained_variance_first": pretraining[0]["critic_pretrain/explained_variance"],
            "pretrain_explained_variance_last": pretraining[-1]["critic_pretrain/explained_variance"],
        }
    if steps_ and "advantages/lam_mean" in steps_[0]:
        result["lam_mean"] = _mean(steps_, "advantages/lam_mean")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=None, help="folder for the runs and results.json (default: a temp folder)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix="critic_curves_"))
    results: dict[str, list[dict]] = {name: [] for name in args.settings}
    for seed in args.seeds:
        _, _, base = _pipeline(out / f"seed{seed}", seed)
        for name in args.settings:
            result = {"setting": name, "seed": seed, **_ppo(out / f"seed{seed}", base, name, args.steps, args.window)}
            print(json.dumps(result), flush=True)
            results[name].append(result)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nmeans over seeds {args.seeds} (min-max); windows of {args.window} steps; runs in {out}")
    for name, runs in results.items():
        parts = []
        for key in runs[0]:
            if key in ("setting", "seed"):
                continue
            values = [r[key] for r in runs]
            parts.append(f"{key} {statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        print(f"{name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()

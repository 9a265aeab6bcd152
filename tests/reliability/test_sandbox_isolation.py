"""The sandbox and the reward workers, issue 24 items 13 and 19–21: a reward worker dies with its trainer,
the program sees neither the host's processes nor its files, start-up is not the program's time, and a
process the program forks cannot spoil the harness's events."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from posttrain.rewards import sandbox
from posttrain.rewards.sandbox import isolation_level, run_program

needs_namespaces = pytest.mark.skipif(
    isolation_level() != "namespaces+uid", reason="needs root and mount/network namespaces"
)


# --------------------------------------------------------------------------------------------------
# Item 13: a forked reward worker dies with the trainer
# --------------------------------------------------------------------------------------------------

TRAINER = """
import os, sys, time
from posttrain.rewards.base import call_with_timeout


def hang(prompts, completions, **columns):
    print(os.getpid(), flush=True)
    time.sleep(600)


call_with_timeout(hang, ["p"], ["c"], {}, timeout=600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_reward_worker_dies_with_its_trainer():
    """Item 13: a hung worker lived on after its trainer was killed (16 s and more; until its own
    deadline). It now gets SIGKILL as soon as the trainer dies."""
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True)
    worker = int(trainer.stdout.readline())
    try:
        assert _alive(worker)
        trainer.kill()
        trainer.wait()
        for _ in range(50):  # up to 5 s; it takes milliseconds
            if not _alive(worker):
                break
            time.sleep(0.1)
        assert not _alive(worker), "the reward worker outlived its trainer"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
        trainer.stdout.close()


# --------------------------------------------------------------------------------------------------
# Item 19: what the program sees of the host
# --------------------------------------------------------------------------------------------------


@needs_namespaces
def test_the_program_sees_no_host_process_and_no_host_file():
    """Item 19: the program could read world-readable host files (the checkout) and /proc/*/cmdline of
    every host process. It now runs in a PID namespace and a root of its own: the system's /usr and /lib*,
    the interpreter's folders, four devices and private tmpfs, all read-only but the tmpfs."""
    mine = Path("/proc/self/cmdline").read_bytes()
    this_file = os.path.realpath(__file__)
    assert sandbox._readable_by_others(this_file)  # so before, the program could read it
    code = textwrap.dedent("""
        import os, json, decimal, sqlite3, ssl
        PIDS = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        CMDLINES = [open(f'/proc/{p}/cmdline', 'rb').read() for p in PIDS]
    """)
    tests = [
        f"assert {mine!r} not in CMDLINES",
        "assert PIDS == [1, os.getpid()]",  # the namespace's first process and the program
        f"assert not os.path.exists({this_file!r})",
        "assert not os.path.exists('/etc/passwd') and not os.path.exists('/home')",
        "assert os.listdir('/etc') == ['ld.so.cache'] or not os.path.exists('/etc/ld.so.cache')",
        "open('/tmp/mine.txt', 'w').write('fine')",  # the private tmpfs
        "assert decimal.Decimal('0.1') * 3 == decimal.Decimal('0.3')",  # the standard library works
    ]
    result = run_program(code, tests, timeout=10)
    if result.private_root_error:
        pytest.skip(f"this kernel refuses the private root: {result.private_root_error}")
    assert result.private_pids and result.private_files, result
    assert (result.status, result.passed) == ("ok", len(tests)), result.errors


# --------------------------------------------------------------------------------------------------
# Item 20: the timeout is the program's time, not the interpreter's start-up
# --------------------------------------------------------------------------------------------------


def _slow_start(monkeypatch, seconds: float) -> None:
    """Start-up slowed artificially: the sandbox process sleeps before it does anything."""
    monkeypatch.setattr(sandbox, "_BOOTSTRAP", f"import time\ntime.sleep({seconds})\n" + sandbox._BOOTSTRAP)


def test_start_up_is_not_counted_in_the_program_timeout(monkeypatch):
    """Item 20: a 0.2 s timeout counted the interpreter's start-up (2 of 3 trivial programs timed out
    under load). With start-up slowed by 1.5 s, a trivial program with a 0.5 s timeout passes."""
    _slow_start(monkeypatch, 1.5)
    result = run_program("x = 1", ["assert x == 1"], timeout=0.5)
    assert (result.status, result.score) == ("ok", 1.0), result
    assert result.startup >= 1.5


def test_the_program_itself_is_still_timed_and_start_up_has_its_own_limit(monkeypatch):
    _slow_start(monkeypatch, 1.0)
    slow = run_program("import time\ntime.sleep(30)", ["assert True"], timeout=0.5)
    assert (slow.status, slow.reason, slow.score) == ("timeout", "timeout after 0.5 s", 0.0)
    monkeypatch.setattr(sandbox, "STARTUP_TIMEOUT", 0.2)
    stuck = run_program("x = 1", ["assert x == 1"], timeout=30)
    assert stuck.status == "timeout" and stuck.score == 0.0
    assert stuck.reason == "the sandbox did not start within 0.2 s (not counted in the timeout)"


# --------------------------------------------------------------------------------------------------
# Item 21: only the harness's own process reports
# --------------------------------------------------------------------------------------------------

FORKS = {
    "a child that raises SystemExit": "import os\nif os.fork() == 0:\n    raise SystemExit\nos.wait()\nx = 1",
    "a child that exits with a status": "import os, sys\nif os.fork() == 0:\n    sys.exit(3)\nos.wait()\nx = 1",
    "a child that raises an error": "import os\nif os.fork() == 0:\n    raise ValueError('child')\nos.wait()\nx = 1",
    "a child that runs on to the end": "import os\nchild = os.fork()\nif child:\n    os.waitpid(child, 0)\nx = 1",
}


@pytest.mark.parametrize("name", list(FORKS))
def test_a_process_the_program_forks_does_not_count_as_tampering(name):
    """Item 21: a forked child's SystemExit was reported as the program's failure next to the parent's
    success, and the result scored 0 as "tampered"."""
    result = run_program(FORKS[name], ["assert x == 1", "assert x == 2"], timeout=10)
    assert (result.status, result.passed, result.score) == ("ok", 1, 0.5), result
    assert result.errors == ["AssertionError: "]

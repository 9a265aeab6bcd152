"""A sandbox for running model-written code: a separate process per program, confined and killed on time.

Each program runs in a fresh ``python -I`` process, started in its own session, with:

- a wall-clock timeout: past it the whole process group is killed (SIGKILL);
- ``resource`` limits: CPU seconds, address space (memory), file size, open files, no core dumps,
  and a cap on processes (a fork bomb runs out of processes, then out of time);
- a fresh working directory (and HOME/TMPDIR) that is deleted afterwards;
- an environment with nothing inherited: no tokens, keys or proxies reach the code;
- when the parent runs as root (as on these machines): new network and mount namespaces — no
  network at all, private tmpfs over /tmp, /var/tmp and /dev/shm — and an unprivileged user id of
  its own per worker slot, so writes outside the sandbox fail with "Permission denied" and every
  process the program left behind is found and killed by that user id.

Without root none of the namespace or user-id steps is possible: the process, time, memory and
environment limits still hold, but the code can reach the network and write wherever the current
user can. ``isolation_level()`` says which level is in force here. The harness reports results on a
private pipe; it contains damage, it does not make results tamper-proof against code written to
forge them.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
_FIRST_UID = 61000  # unprivileged user ids of the worker slots (root mode)


def _readable_by_others(path: str) -> bool:
    """Whether a user with no rights of its own can reach ``path`` (o+x on every folder, o+r on it)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
        if not mode & (0o001 if i < len(parts) else 0o004):
            return False
    return True


def _sandbox_python() -> str:
    """An interpreter the sandbox's unprivileged user can run: this one when its standard library is
    readable by others, else the system's. The bootstrap needs the standard library only."""
    import sysconfig

    if not IS_ROOT or _readable_by_others(sysconfig.get_paths()["stdlib"]):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _readable_by_others(candidate):
            return candidate
    return sys.executable


SANDBOX_PYTHON = _sandbox_python()

# Runs as the sandbox process: confine itself, drop privileges, run the program and each test.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys, traceback
job = json.loads(sys.stdin.read())
results = os.fdopen(job["results_fd"], "w", buffering=1)
def report(**kw):
    results.write(json.dumps(kw) + "\n")
if job["uid"] is not None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000 | 0x40000000) == 0:  # CLONE_NEWNS | CLONE_NEWNET
        libc.mount(b"none", b"/", None, 16384 | (1 << 18), None)  # MS_REC | MS_PRIVATE
        for target in (b"/tmp", b"/var/tmp", b"/dev/shm"):
            if os.path.isdir(target):
                libc.mount(b"tmpfs", target, b"tmpfs", 0, b"size=64m,mode=1777")
        os.makedirs("/tmp/sandbox", exist_ok=True)
        os.chown("/tmp/sandbox", job["uid"], job["uid"])
        os.chdir("/tmp/sandbox")
        os.environ["HOME"] = os.environ["TMPDIR"] = "/tmp/sandbox"
        report(event="namespaces")
limits = job["limits"]
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
if job["uid"] is not None:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
namespace = {"__name__": "__main__"}
try:
    exec(compile(job["code"], "<completion>", "exec"), namespace)
except BaseException as err:
    report(event="program", ok=False, error=f"{type(err).__name__}: {err}"[:500])
    sys.exit(0)
report(event="program", ok=True)
for i, test in enumerate(job["tests"]):
    try:
        exec(compile(test, f"<test {i}>", "exec"), namespace)
        report(event="test", index=i, ok=True)
    except BaseException as err:
        report(event="test", index=i, ok=False, error=f"{type(err).__name__}: {err}"[:300])
"""


@dataclass
class SandboxResult:
    """What happened to one program."""

    passed: int = 0
    total: int = 0
    status: str = "ok"  # ok | error | timeout | crashed
    reason: str = ""  # why the score is not full: the first error, "timeout after 5.0 s", ...
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    isolated: bool = False  # namespaces and a private user id were in force
    errors: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Share of tests passed; 0 when the program failed, crashed or timed out (also after its tests)."""
        if self.status != "ok":
            return 0.0
        return self.passed / self.total if self.total else 1.0


def _clean_env(workdir: str) -> dict[str, str]:
    # nothing inherited: no API keys, tokens, proxies or cloud credentials reach the code
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (the leftovers of a program: daemons, fork-bomb children)."""
    for _ in range(5):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid_line = next(line for line in f if line.startswith("Uid:"))
                if int(uid_line.split()[1]) == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except (OSError, StopIteration, ValueError):
                continue
        if not found:
            return
        time.sleep(0.05)


def run_program(
    code: str, tests: list[str] = (), timeout: float = 5.0, memory_mb: int = 512, max_processes: int = 16, slot: int = 0
) -> SandboxResult:
    """Run ``code`` then each test (Python statements, e.g. ``assert f(2) == 4``) in the sandbox."""
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    uid = _FIRST_UID + slot if IS_ROOT else None
    if uid is not None:
        os.chown(workdir, uid, uid)
    read_fd, write_fd = os.pipe()
    limits = {
        "cpu": max(1, int(timeout + 0.999)),
        "memory": memory_mb * 2**20,
        "fsize": 16 * 2**20,
        "nproc": max_processes if IS_ROOT else _user_processes() + max_processes,
    }
    job = {"code": code, "tests": list(tests), "uid": uid, "limits": limits, "results_fd": write_fd}
    start = time.perf_counter()
    result = SandboxResult(total=len(tests))
    proc = subprocess.Popen(
        [SANDBOX_PYTHON, "-I", "-c", _BOOTSTRAP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(write_fd,),
        cwd=workdir,
        env=_clean_env(workdir),
        start_new_session=True,
    )
    os.close(write_fd)
    stdout = stderr = b""
    try:
        stdout, stderr = proc.communicate(json.dumps(job).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        result.status, result.reason = "timeout", f"timeout after {timeout:g} s"
    finally:
        # the group, then (root) every process of the slot's user id: daemons that left the group too
        with _suppress():
            os.killpg(proc.pid, signal.SIGKILL)
        if uid is not None:
            _kill_uid(uid)
        if result.status == "timeout":
            with _suppress():
                stdout, stderr = proc.communicate(timeout=1.0)
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    result.seconds = time.perf_counter() - start
    result.stdout, result.stderr = stdout.decode(errors="replace")[-2000:], stderr.decode(errors="replace")[-2000:]
    with os.fdopen(read_fd) as pipe:
        events = [json.loads(line) for line in pipe.read().splitlines() if line.startswith("{")]
    result.isolated = any(e["event"] == "namespaces" for e in events)
    program = [e for e in events if e["event"] == "program"]
    tests_done = [e for e in events if e["event"] == "test"]
    result.passed = sum(e["ok"] for e in tests_done)
    result.errors = [e["error"] for e in events if not e.get("ok", True)]
    if result.status == "timeout":
        result.passed = sum(e["ok"] for e in tests_done)
        return result
    if not program:
        result.status, result.reason = "crashed", _crash_reason(proc.returncode, result.stderr)
    elif not program[0]["ok"]:
        result.status, result.reason = "error", program[0]["error"]
    elif len(tests_done) < len(tests):
        result.status, result.reason = "crashed", _crash_reason(proc.returncode, result.stderr)
    elif result.passed < len(tests):
        result.reason = next(e["error"] for e in tests_done if not e["ok"])
    return result


def _crash_reason(returncode: int | None, stderr: str) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    tail = stderr.strip().splitlines()[-1:] or [""]
    return f"exited with status {returncode} before finishing the tests {tail[0][:200]}".strip()


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count


class _suppress:
    """Ignore the OSError (process already gone) and TimeoutExpired (pipes held by a killed daemon's
    orphan) of clean-up steps."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError | subprocess.TimeoutExpired)


_LEVEL: list[str] = []


def isolation_level() -> str:
    """ "namespaces+uid", "uid" (root, but the kernel refused new namespaces) or "rlimits-only" (not root).

    Probed once by running an empty program."""
    if not _LEVEL:
        if not IS_ROOT:
            _LEVEL.append("rlimits-only")
        else:
            _LEVEL.append("namespaces+uid" if run_program("pass", timeout=10.0).isolated else "uid")
    return _LEVEL[0]


def run_programs(jobs: list[tuple[str, list[str]]], max_workers: int = 4, **limits) -> list[SandboxResult]:
    """Run many (code, tests) jobs concurrently, at most ``max_workers`` at a time, each in its own slot."""
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(max_workers):
        slots.put(slot)

    def one(job):
        slot = slots.get()
        try:
            return run_program(job[0], job[1], slot=slot, **limits)
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(one, jobs))

"""A sandbox for running model-written code: a separate process per program, confined and killed on time.

Each program runs in a fresh ``python -I`` process, started in its own session, with:

- a wall-clock timeout on the program, counted from the moment the harness is ready to run it (the
  interpreter's start-up and the confinement have a limit of their own, ``STARTUP_TIMEOUT``): past it
  the whole process group is killed (SIGKILL); the program also dies with the process that started it
  (parent-death signal), so a killed reward worker leaves none;
- ``resource`` limits: CPU seconds, address space (memory), file size, open files, no core dumps,
  and a cap on processes (a fork bomb runs out of processes, then out of time);
- its output read as it comes, keeping only the last ``OUTPUT_KEEP`` bytes of each stream (a program
  that prints in a loop costs the trainer no memory) within the same deadline;
- a fresh working directory (and HOME/TMPDIR) that is deleted afterwards;
- an environment with nothing inherited: no tokens, keys or proxies reach the code;
- when the parent runs as root (as on these machines): new network and mount namespaces — no
  network at all, every mount read-only (``/run/lock`` included) but private tmpfs over /tmp,
  /var/tmp and /dev/shm — and an unprivileged user id of its own, so writes outside the sandbox fail
  and every process the program left behind is found and killed by that user id. User ids come from
  a block of ``UID_BLOCK`` leased per trainer process (an flock'd lease file), so two trainers or two
  ranks on one host never share one;
- also as root: a root folder of its own (chroot) holding only the system's programs and libraries
  (/usr, /bin, /sbin, /lib*), the sandbox interpreter's own folders, /etc/ld.so.cache, /dev/null,
  zero, random and urandom, a fresh /proc and private tmpfs at /tmp and /dev/shm, all read-only but
  the tmpfs: no host folder beyond those (not the checkout, /home, /root, /etc, /opt, /srv, /run);
  and a PID namespace: /proc shows only the program's own processes (no host /proc/*/cmdline), a
  process it leaves running holds the result until the deadline, and all die with the namespace.
  Each step the kernel refuses is left out, and the result says which held (``isolated``,
  ``read_only``, ``private_files``, ``private_pids``).

Without root none of the namespace, root-folder or user-id steps is taken (they need CAP_SYS_ADMIN
and setuid; an unprivileged user namespace could give the namespaces on kernels that allow one, which
this sandbox does not attempt): the process, time, memory and environment limits still hold, but the
code can reach the network, read what the current user can read (every world-readable file,
/proc/*/cmdline of every process) and write wherever the current user can.
``isolation_level()`` says which level is in force here. The harness reports results on a private
pipe; the events must come in the harness's own order (program, then tests 0, 1, ... once each) or
the result is marked ``tampered`` and scores 0; a process the program forks reports nothing and
ends where the program (or the test) it ran in ends, so only the harness's own events count. That
catches a program that writes extra or repeated "passed" events; it cannot catch one that forges the
exact sequence and then exits before the real tests run, since the program shares the harness's
process.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
# Unprivileged user ids of the sandboxes (root mode), in blocks of UID_BLOCK from FIRST_UID. Versions
# before the leases used 61000 + worker slot for every process: the blocks start above those.
FIRST_UID = 62000
UID_BLOCK = 64  # user ids leased to one process: the most programs it runs at once
UID_BLOCKS = 48  # blocks on a host: FIRST_UID + 48·64 stays below 65534 (nobody)
OUTPUT_KEEP = 64 * 2**10  # bytes kept of each of stdout and stderr (the last ones)
# Seconds the sandbox process may take to start (the interpreter, the namespaces, the privileges) before
# the program's own ``timeout`` starts: a loaded machine slows start-up, and it is not the program's time.
STARTUP_TIMEOUT = 10.0
_READY = b'{"event": "ready"}\n'  # the harness's line on the results channel just before the program runs
_RESULTS_MAX = 2**20  # bytes of result events beyond which the channel is taken as flooded
_LEASE_DIR = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()


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
import ctypes, json, os, resource, select, signal, sys
job = json.loads(sys.stdin.read())
libc = ctypes.CDLL(None, use_errno=True)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
parent = job["parent"]
def die_with_parent():
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL (cleared by setuid: set again after it)
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)
die_with_parent()
results = os.fdopen(job["results_fd"], "w", buffering=1)
harness = os.getpid()
def report(**kw):
    if os.getpid() == harness:  # only the harness's own events count, none of a process the program forked
        results.write(json.dumps(kw) + "\n")
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
def mount(source, target, fstype, flags, data=None):
    return libc.mount(source, target, fstype, flags, data) == 0
def bind(source, target):  # ``source`` read-only at ``target``, with the mounts below it
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    if not mount(source.encode(), target.encode(), None, MS_BIND | MS_REC):
        raise OSError(ctypes.get_errno(), f"cannot bind {source}")
    mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
def build_root():
    # All the program will see of the files: the system's programs and libraries (/usr, /bin, /lib*), this
    # interpreter's folders, /etc/ld.so.cache, four devices, and private tmpfs at /tmp and /dev/shm; all
    # read-only but the tmpfs. None of the host's other folders (/home, /root, /etc, /opt, /srv, /run, ...).
    root, done = "/tmp/.root", []
    os.makedirs(root)
    mount(b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755")
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(top), root + top)
        elif os.path.isdir(top):
            bind(top, root + top)
            done.append(top)
    wanted = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)]
    wanted += [os.path.dirname(os.path.realpath(sys.executable))] + [p for p in sys.path if p]
    for path in sorted({os.path.realpath(p) for p in wanted}, key=len):
        if os.path.exists(path) and not any(path == d or path.startswith(d + "/") for d in done):
            bind(path, root + path)
            done.append(path)
    if os.path.exists("/etc/ld.so.cache"):
        bind("/etc/ld.so.cache", root + "/etc/ld.so.cache")
    for device in ("null", "zero", "random", "urandom"):
        bind("/dev/" + device, root + "/dev/" + device)
    for private in ("/tmp", "/dev/shm"):
        os.makedirs(root + private, exist_ok=True)
        mount(b"tmpfs", (root + private).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64m,mode=1777")
    os.makedirs(root + "/proc")
    return root
TERMINATING = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 31}
def exit_as(code):  # end with the program's status: a code above 128 from pid 1 means killed by that signal
    if code > 128 and code - 128 in TERMINATING:
        try:
            signal.signal(code - 128, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), code - 128)
    os._exit(code & 255)
def status_code(status):
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
def enter(root):  # the root folder, or None (and why) when the kernel refuses it
    try:
        os.chroot(root)
        return root
    except OSError as err:
        isolation["files_error"] = str(err)[:200]
        return None
if job["uid"] is not None:
    if libc.unshare(0x00020000 | 0x40000000) == 0:  # CLONE_NEWNS | CLONE_NEWNET
        mount(b"none", b"/", None, MS_REC | (1 << 18))  # MS_PRIVATE
        # every mount read-only (MS_REMOUNT | MS_BIND | MS_RDONLY, keeping nosuid/nodev/noexec/atime flags)
        flags = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
        read_only = False
        for line in open("/proc/self/mountinfo").read().splitlines():
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode()
            extra = sum(flags.get(option, 0) for option in fields[5].split(","))
            done = mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
            read_only = read_only or (done and point == b"/")
        for target in (b"/tmp", b"/var/tmp", b"/dev/shm"):
            if os.path.isdir(target):
                mount(b"tmpfs", target, b"tmpfs", 0, b"size=64m,mode=1777")
        isolation = {"read_only": read_only, "pids": False, "files": False}
        root = None
        try:
            root = build_root()
        except OSError as err:
            isolation["files_error"] = str(err)[:200]
        # A PID namespace: the program sees no process of the host (no /proc/*/cmdline), and every process
        # it leaves dies with the namespace. Its first process (pid 1) only mounts /proc, reaps until every
        # process of the namespace ended (a daemon left behind runs into the timeout, as the program's own
        # time) and passes the program's exit status on; the program runs in its child.
        if libc.unshare(0x20000000) == 0:  # CLONE_NEWPID
            alive, held = os.pipe()  # ``held`` stays open in this process only: EOF on ``alive`` = it died
            init = os.fork()
            if init:
                os.close(alive)
                exit_as(status_code(os.waitpid(init, 0)[1]))
            os.close(held)
            libc.prctl(1, 9)
            if select.select([alive], [], [], 0)[0]:  # this process's parent died before the signal was set
                os._exit(1)
            os.close(alive)
            if root is not None:  # the namespace's /proc inside the private root, then into it
                inside = mount(b"proc", (root + "/proc").encode(), b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                root = enter(root)
                isolation["pids"] = inside and root is not None
            if root is None:  # no private root, or the kernel refused it: the namespace's /proc over the host's
                isolation["pids"] = mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            program = os.fork()
            if program:  # pid 1: reap the program and every process it left, then end with its status
                code = 1
                while True:
                    try:
                        reaped, status = os.wait()
                    except ChildProcessError:
                        os._exit(code if code >= 0 else 128 - code)
                    if reaped == program:
                        code = status_code(status)
            harness, parent = os.getpid(), 1
            die_with_parent()
        elif root is not None:
            root = enter(root)
        isolation["files"] = root is not None
        os.makedirs("/tmp/sandbox", exist_ok=True)
        os.chown("/tmp/sandbox", job["uid"], job["uid"])
        os.chdir("/tmp/sandbox")
        os.environ["HOME"] = os.environ["TMPDIR"] = "/tmp/sandbox"
        report(event="namespaces", **isolation)
limits = job["limits"]
# the CPU limit counts from here, as the timeout counts from "ready": the start-up's CPU seconds are added
used = resource.getrusage(resource.RUSAGE_SELF)
spent = int(used.ru_utime + used.ru_stime) + 1
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"] + spent, limits["cpu"] + spent + 1))
resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
if job["uid"] is not None:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
    die_with_parent()
def end_if_forked(err=None):
    # a process the program forked ends where the program (or the test) ends: it reports nothing and
    # runs no test; its exit status is its own
    if os.getpid() != harness:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        code = 0 if err is None else 1
        if isinstance(err, SystemExit):
            code = err.code if isinstance(err.code, int) else 0 if err.code is None else 1
        os._exit(code & 255)
namespace = {"__name__": "__main__"}
report(event="ready")  # the program's time starts here: the interpreter's start-up and the confinement are done
try:
    exec(compile(job["code"], "<completion>", "exec"), namespace)
except BaseException as err:
    end_if_forked(err)
    report(event="program", ok=False, error=f"{type(err).__name__}: {err}"[:500])
    sys.exit(0)
end_if_forked()
report(event="program", ok=True)
for i, test in enumerate(job["tests"]):
    try:
        exec(compile(test, f"<test {i}>", "exec"), namespace)
    except BaseException as err:
        end_if_forked(err)
        report(event="test", index=i, ok=False, error=f"{type(err).__name__}: {err}"[:300])
    else:
        end_if_forked()
        report(event="test", index=i, ok=True)
"""


# --------------------------------------------------------------------------------------------------
# User-id leases: one block per process, held by an flock until the process ends
# --------------------------------------------------------------------------------------------------

_lease_state: dict = {}  # "fd", "first_uid" (root), "owner" (the pid that leased), "slots"
_lease_lock = threading.Lock()


def lease() -> int | None:
    """The first user id of this process's block (None without root), leased on first use.

    A forked child (a reward worker) keeps its parent's block: its programs are the parent's to reap.
    A block whose previous holder died is cleaned (its processes killed, its folders removed) first."""
    with _lease_lock:
        if not _lease_state:
            _lease_state["owner"] = os.getpid()
            _lease_state["first_uid"] = _lease_block() if IS_ROOT else None
            _lease_state["slots"] = queue.Queue()
            for slot in range(UID_BLOCK):
                _lease_state["slots"].put(slot)
            reap()
        return _lease_state["first_uid"]


def _lease_block() -> int:
    for block in range(UID_BLOCKS):
        path = os.path.join(_LEASE_DIR, f"posttrain-sandbox-uids-{block}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _lease_state["fd"] = fd  # held open (and locked) for the life of the process
        return FIRST_UID + block * UID_BLOCK
    raise RuntimeError(f"all {UID_BLOCKS} sandbox user-id blocks are leased by running processes ({_LEASE_DIR})")


def _folder_prefix(slot: int) -> str:
    if _lease_state["first_uid"] is None:
        return f"posttrain-sandbox-p{_lease_state['owner']}-"
    return f"posttrain-sandbox-u{_lease_state['first_uid'] + slot}-"


def reap() -> None:
    """Kill every program of this process's block and remove their folders: what a killed reward
    worker (or a dead previous holder of the block) left behind. Call when none of this process's
    own sandboxes is running."""
    if not _lease_state:
        return
    if _lease_state["first_uid"] is not None:
        first = _lease_state["first_uid"]
        _kill_uids(set(range(first, first + UID_BLOCK)))
        prefixes = [_folder_prefix(slot) for slot in range(UID_BLOCK)]
    else:
        prefixes = [_folder_prefix(0)]
    for prefix in prefixes:
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*")):
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class SandboxResult:
    """What happened to one program."""

    passed: int = 0
    total: int = 0
    status: str = "ok"  # ok | error | timeout | crashed | tampered
    reason: str = ""  # why the score is not full: the first error, "timeout after 5.0 s", ...
    seconds: float = 0.0
    stdout: str = ""  # the last 2000 characters
    stderr: str = ""
    output_bytes: int = 0  # all the program wrote to stdout and stderr (only the tails are kept)
    isolated: bool = False  # namespaces and a private user id were in force
    read_only: bool = False  # and every mount but the private tmpfs was read-only
    private_pids: bool = False  # and a PID namespace: the program saw none of the host's processes
    private_files: bool = False  # and a root of its own: the system's /usr and /lib*, the interpreter, tmpfs
    private_root_error: str = ""  # why the kernel refused that root, when it did
    startup: float = 0.0  # seconds until the sandbox process was ready to run the program (not timed)
    errors: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Share of tests passed in [0, 1]; 0 when the program failed, crashed, timed out (also after its
        tests) or tampered with the results channel."""
        if self.status != "ok":
            return 0.0
        return min(self.passed, self.total) / self.total if self.total else 1.0


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


def _kill_uids(uids: set[int]) -> None:
    """SIGKILL every process of ``uids`` (the leftovers of programs: daemons, fork-bomb children)."""
    for _ in range(5):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    uid_line = next(line for line in f if line.startswith("Uid:"))
                if int(uid_line.split()[1]) in uids:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except (OSError, StopIteration, ValueError):
                continue
        if not found:
            return
        time.sleep(0.05)


class _Tail:
    """The last ``keep`` bytes written to a stream, and how many there were in all."""

    def __init__(self, keep: int):
        self.keep, self.total, self.data = keep, 0, bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if len(self.data) > 2 * self.keep:  # trim in bulk: amortised O(1) per byte
            del self.data[: -self.keep]

    def text(self, chars: int) -> str:
        return bytes(self.data[-self.keep :]).decode(errors="replace")[-chars:]


def _exchange(proc, job: bytes, results_fd: int, timeout: float) -> tuple[_Tail, _Tail, bytes, bool, float | None]:
    """Write the job to stdin, read stdout, stderr and the results channel until all three close or the
    deadline passes, keeping bounded amounts. The deadline is ``STARTUP_TIMEOUT`` from now until the
    harness says it is ready, then ``timeout`` from that moment. Returns (stdout, stderr, results,
    finished in time, seconds until ready or None)."""
    out, err, results = _Tail(OUTPUT_KEEP), _Tail(OUTPUT_KEEP), bytearray()
    start = time.monotonic()
    deadline, ready = start + STARTUP_TIMEOUT, None
    readers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, results_fd: None}
    stdin, pending = proc.stdin.fileno(), memoryview(job)
    os.set_blocking(stdin, False)
    while readers:
        left = deadline - time.monotonic()
        if left <= 0:
            return out, err, bytes(results), False, ready
        writers = [stdin] if pending is not None else []
        readable, writable, _ = select.select(list(readers), writers, [], left)
        if writable:
            try:
                pending = pending[os.write(stdin, pending[:65536]) :]
            except BrokenPipeError:
                pending = memoryview(b"")
            if not len(pending):
                proc.stdin.close()
                pending = None
        for fd in readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                del readers[fd]
            elif readers[fd] is not None:
                readers[fd].add(chunk)
            elif len(results) < _RESULTS_MAX:
                results += chunk
                if ready is None and _READY in results:  # nothing but the harness writes before it
                    ready = time.monotonic() - start
                    deadline = start + ready + timeout
    try:
        proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return out, err, bytes(results), False, ready
    return out, err, bytes(results), True, ready


def run_program(
    code: str,
    tests: list[str] = (),
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 16,
    slot: int | None = None,
) -> SandboxResult:
    """Run ``code`` then each test (Python statements, e.g. ``assert f(2) == 4``) in the sandbox.

    ``slot``: which user id of this process's block to use; None takes a free one."""
    first_uid = lease()
    if slot is None:
        slot = _lease_state["slots"].get()
        try:
            return run_program(code, tests, timeout, memory_mb, max_processes, slot)
        finally:
            _lease_state["slots"].put(slot)
    uid = None if first_uid is None else first_uid + slot
    workdir = tempfile.mkdtemp(prefix=_folder_prefix(slot))
    if uid is not None:
        os.chown(workdir, uid, uid)
    read_fd, write_fd = os.pipe()
    limits = {
        "cpu": max(1, int(timeout + 0.999)),
        "memory": memory_mb * 2**20,
        "fsize": 16 * 2**20,
        "nproc": max_processes if IS_ROOT else _user_processes() + max_processes,
    }
    job = {
        "code": code,
        "tests": list(tests),
        "uid": uid,
        "limits": limits,
        "results_fd": write_fd,
        "parent": os.getpid(),
    }
    start = time.perf_counter()
    result = SandboxResult(total=len(tests))
    try:
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
    finally:
        os.close(write_fd)
    try:
        out, err, events, in_time, ready = _exchange(proc, json.dumps(job).encode(), read_fd, timeout)
    finally:
        # the group, then (root) every process of the slot's user id: daemons that left the group too
        with _suppress():
            os.killpg(proc.pid, signal.SIGKILL)
        if uid is not None:
            _kill_uids({uid})
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with _suppress():
                stream.close()
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)
    result.seconds = time.perf_counter() - start
    result.stdout, result.stderr = out.text(2000), err.text(2000)
    result.output_bytes = out.total + err.total
    result.startup = result.seconds if ready is None else ready
    if not in_time:
        result.status, result.reason = "timeout", f"timeout after {timeout:g} s"
        if ready is None:
            result.reason = f"the sandbox did not start within {STARTUP_TIMEOUT:g} s (not counted in the timeout)"
    _read_events(result, events, proc.returncode)
    if result.status == "crashed" and proc.returncode == -signal.SIGXCPU:  # its CPU limit, set from the timeout
        result.status, result.reason = "timeout", f"timeout after {timeout:g} s (its CPU time ran out)"
    return result


def _read_events(result: SandboxResult, events: bytes, returncode: int | None) -> None:
    """Fill ``result`` from the results channel, which must hold the harness's events in its order:
    [namespaces], ready, program, test 0, test 1, ... each once. Anything else is tampering (score 0)."""
    parsed = []
    try:
        parsed = [json.loads(line) for line in events.decode().splitlines()]
        expected = ["program"] + [("test", i) for i in range(result.total)]
        if parsed and parsed[0].get("event") == "namespaces":
            result.isolated, result.read_only = True, parsed[0].get("read_only") is True
            result.private_pids, result.private_files = parsed[0].get("pids") is True, parsed[0].get("files") is True
            result.private_root_error = str(parsed[0].get("files_error") or "")
            parsed = parsed[1:]
        if parsed and parsed[0] == {"event": "ready"}:
            parsed = parsed[1:]
        elif parsed:
            raise ValueError("events before the harness was ready")
        seen = [e["event"] if e["event"] == "program" else (e["event"], e["index"]) for e in parsed]
        if (
            len(events) >= _RESULTS_MAX
            or seen != expected[: len(seen)]
            or not all(isinstance(e.get("ok"), bool) for e in parsed)
        ):
            raise ValueError("events out of the harness's order")
    except (ValueError, KeyError, TypeError, AttributeError):
        result.status, result.reason, result.passed = "tampered", "the results channel held forged events", 0
        return
    program, tests_done = parsed[:1], parsed[1:]
    result.passed = sum(e["ok"] for e in tests_done)
    result.errors = [str(e.get("error", "")) for e in parsed if not e["ok"]]
    if result.status == "timeout":
        return
    if not program:
        result.status, result.reason = "crashed", _crash_reason(returncode, result.stderr)
    elif not program[0]["ok"]:
        result.status, result.reason = "error", str(program[0].get("error"))
    elif len(tests_done) < result.total:
        result.status, result.reason = "crashed", _crash_reason(returncode, result.stderr)
    elif result.passed < result.total:
        result.reason = next(str(e.get("error")) for e in tests_done if not e["ok"])


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
    """Run many (code, tests) jobs concurrently, at most ``max_workers`` at a time, each with a user id
    of this process's block that no other running program has."""
    with ThreadPoolExecutor(max_workers=min(max_workers, UID_BLOCK)) as pool:
        return list(pool.map(lambda job: run_program(job[0], job[1], **limits), jobs))

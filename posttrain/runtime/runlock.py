"""One run per run folder: an exclusive lock on ``<run.output_dir>/.posttrain.lock`` for the run's life.

Without it, two runs on one ``run.output_dir`` both run to the end, each step twice in ``metrics.jsonl`` and
whichever ``final/`` finished last. ``locked_run_dir`` (called by
``inputs.check_inputs``, before any model loads) takes an exclusive, non-blocking ``fcntl.lockf`` lock on
the lock file and writes its PID there; a second run on the folder stops at start with one line naming
the first run's PID (``UserError``). The kernel drops the lock when the process ends, however it ends (a
crash, a kill -9), so a stale lock file never blocks the next run; ``release_run_dir`` (the end of the
run) removes the file. A POSIX ``lockf`` lock rather than ``flock``: a child forked from the trainer (a
reward worker) does not inherit it, so a worker that outlives a killed trainer does not keep the folder
locked (an ``flock`` lock lives as long as any process holds the file open); it works on NFS as well.
Under torchrun, accelerate or mpirun only the process of rank 0 takes the lock: the other processes of
the same run share the folder with it.

The lock is per process and re-entrant: the CLI and the trainer both run the input checks, and a
Python session may run one run after another on the same folder.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import os
import socket
import time
from pathlib import Path

from posttrain.errors import UserError

LOCK_FILE = ".posttrain.lock"
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
_held: dict[str, int] = {}  # resolved run folder -> the open, locked file descriptor
_owner = os.getpid()  # a forked child (which holds no lock) never removes a lock file


def launch_rank() -> int:
    """This process's rank as the launcher set it (torchrun, accelerate, mpirun), before any process group."""
    for variable in _RANK_VARIABLES:
        if os.environ.get(variable):
            return int(os.environ[variable])
    return 0


def _holder(path: Path) -> str:
    """What the lock file says about the run holding it."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "pid" not in fields:
        return "its PID is not written yet"
    where = f" on {fields['host']}" if fields.get("host") and fields["host"] != socket.gethostname() else ""
    since = f", since {fields['started']}" if fields.get("started") else ""
    return f"PID {fields['pid']}{where}{since}"


def lock_run_dir(output_dir: str | Path) -> bool:
    """Take the run folder's lock (creating the folder) for this process, or raise ``UserError`` naming the
    process that holds it. A no-op on processes other than rank 0 and when this process holds it already.
    Returns whether this call took it."""
    if launch_rank() != 0:
        return False
    folder = Path(output_dir).resolve()
    key = str(folder)
    if key in _held:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    for _ in range(10):  # the holder may remove the file between our open and our lock: then lock the new one
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise UserError(
                f"run.output_dir: {folder} is in use by another posttrain run ({_holder(path)}); wait for it to end "
                "or stop it, or choose another run.output_dir"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise UserError(f"run.output_dir: could not lock {path}: it keeps being replaced by another process")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()} started={started}\n".encode(), 0)
    global _owner
    if not _held:
        atexit.register(_release_all)
    _owner = os.getpid()
    _held[key] = fd
    return True


@contextlib.contextmanager
def locked_run_dir(output_dir: str | Path):
    """``lock_run_dir``, released again when the block raises (the run is refused at start) and this block
    took it; kept otherwise, for the run."""
    took = lock_run_dir(output_dir)
    try:
        yield
    except BaseException:
        if took:
            release_run_dir(output_dir)
        raise


def holds_run_dir(train):
    """Decorate a trainer's ``train(config, ...)``: the run folder's lock, taken by the input checks, is
    released when the run ends, however it ends."""

    @functools.wraps(train)
    def wrapper(config, *args, **kwargs):
        try:
            return train(config, *args, **kwargs)
        finally:
            release_run_dir(config.run.output_dir)

    return wrapper


def release_run_dir(output_dir: str | Path) -> None:
    """Remove the lock file and drop the lock, if this process holds it."""
    key = str(Path(output_dir).resolve())
    fd = _held.pop(key, None)
    if fd is None or os.getpid() != _owner:
        return
    try:
        os.unlink(Path(key) / LOCK_FILE)  # removed while still locked: a process waiting on it retries
    except FileNotFoundError:
        pass
    os.close(fd)


def _release_all() -> None:
    for key in list(_held):
        release_run_dir(key)

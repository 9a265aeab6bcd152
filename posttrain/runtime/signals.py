"""SIGTERM and SIGINT during training: the step under way finishes, a checkpoint is saved, the run says where
in one line and exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, as a shell reports a
process the signal ended). A second signal ends the process at once, by the signal itself.

Schedulers and ``kill`` send SIGTERM first; without the handlers the run dies at once without a checkpoint
and ``run.resume_from=latest`` finds nothing. ``handles_stop_signals`` wraps a training
loop (``loop.run_offline``, ``online.OnlineTrainer.train``): it installs the handlers for the loop's life
and restores the previous ones after, however the loop ends. The loop calls ``stop_if_signalled`` after
each step. A signal during the last step lets the run finish (``final/`` is written, exit 0).

Before the first step, a pass with nothing to save (DPO's and KTO's reference log-probs: minutes on a CPU)
runs under ``stops_at_once``: a signal there ends the run at once, saying so in one line, with the same
exit status (the default handler ended it without a word; SIGINT printed a KeyboardInterrupt traceback).

Under several processes the decision is collective (a max over processes each step), so every process
saves the same checkpoint and stops together, whichever of them the signal reached. A child forked from
the trainer (a reward worker) that inherits the handlers dies of the signal as it did before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading

import torch

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # the first signal of the running loop, if any
_active: list[object] = []  # a token per loop running under handles_stop_signals (nested calls: the outermost)


class TrainingInterrupted(SystemExit):
    """A run stopped by a signal after saving ``checkpoint``; the exit status is 128 + ``signum``."""

    def __init__(self, signum: int, checkpoint, message: str):
        super().__init__(128 + signum)
        self.signum, self.checkpoint, self.message = signum, checkpoint, message

    def __str__(self) -> str:
        return self.message


def _is_main_rank() -> bool:
    from posttrain.runtime.runlock import launch_rank

    return launch_rank() == 0


def _handle(signum, frame) -> None:
    if os.getpid() != _pid or _received:  # a forked child, or the second signal: end now, by the signal
        if os.getpid() == _pid and _is_main_rank():
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint\n".encode())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    if _is_main_rank():  # os.write: a signal may land inside a print, and a buffered stream is not re-entrant
        name = signal.Signals(signum).name
        line = f"{name}: the run stops after the step under way and saves a checkpoint; {name} again exits at once"
        os.write(2, f"\n{line}\n".encode())


_pid = os.getpid()


def handles_stop_signals(loop):
    """Decorate a training loop: SIGTERM / SIGINT set a flag (``stop_if_signalled`` acts on it) for its
    duration; the previous handlers come back after. Outside the main thread (signals cannot be caught
    there) the loop runs as it is; a signal the process ignores stays ignored."""

    @functools.wraps(loop)
    def wrapper(*args, **kwargs):
        global _pid
        if _active or threading.current_thread() is not threading.main_thread():
            return loop(*args, **kwargs)
        _pid = os.getpid()
        _received.clear()
        # a signal the process was started ignoring (SIGINT of a job a script ran in the background) stays ignored
        previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
        _active.append(loop)
        try:
            return loop(*args, **kwargs)
        finally:
            _active.pop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _received.clear()

    return wrapper


@contextlib.contextmanager
def stops_at_once(run_name: str, phase: str):
    """SIGTERM / SIGINT during ``phase``, a pass before step 1 with nothing to save: one line saying so, then
    ``TrainingInterrupted`` at once (exit 128 + the signal). Inside a loop's handlers, or outside the main
    thread, nothing changes; a signal the process ignores stays ignored."""
    if _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def stop(signum, frame):
        if os.getpid() != pid:  # a forked child: it dies of the signal, as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        message = (
            f"[{run_name}] stopped by {name} during {phase}, before step 1: nothing was trained or saved; "
            "run the same command again to start over"
        )
        if _is_main_rank():  # os.write: a signal may land inside a print
            os.write(2, f"\n{message}\n".encode())
        raise TrainingInterrupted(signum, None, message)

    previous = {sig: signal.signal(sig, stop) for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_before_first_step(accelerator, run_name: str, phase: str) -> None:
    """Between the steps of ``phase``, a pass before step 1 run inside a loop's handlers (PPO's value pretraining):
    when a stop signal came (on any process: collective), one line saying that nothing was saved and the run
    starts over, then ``TrainingInterrupted`` (exit 128 + the signal)."""
    signum = signalled(accelerator)
    if signum is None:
        return
    name = signal.Signals(signum).name
    message = (
        f"[{run_name}] stopped by {name} during {phase}, before step 1: nothing was saved; "
        f"run the same command again to start over, {phase} included"
    )
    if accelerator.is_main_process:
        print(message, file=sys.stderr, flush=True)
    raise TrainingInterrupted(signum, None, message)


def signalled(accelerator) -> int | None:
    """The signal that asked the run to stop (on any process), or None. Collective under several processes:
    call it at the same point of every step on every process."""
    signum = _received[0] if _received else 0
    if accelerator.num_processes > 1:
        flag = torch.tensor([float(signum)], device=accelerator.device)
        signum = int(accelerator.gather(flag).max().item())
    return signum or None


def stop_if_signalled(
    accelerator, run_name: str, output_dir, done: int, total_steps: int, saved: bool, save, logger
) -> None:
    """After step ``done``: when a stop signal came (and steps remain), save a checkpoint (``save()``,
    which returns its folder; not when one was ``saved`` at this step already), close the logger, print
    one line saying where, and raise ``TrainingInterrupted`` (exit status 128 + the signal)."""
    signum = signalled(accelerator)
    if signum is None or done >= total_steps:
        return
    from posttrain.runtime.checkpoint import checkpoints_dir

    path = checkpoints_dir(output_dir) / f"step-{done:06d}" if saved else save()
    logger.close()
    name = signal.Signals(signum).name
    message = (
        f"[{run_name}] stopped by {name} after step {done} of {total_steps}: checkpoint saved at {path}; "
        "continue the run with run.resume_from=latest"
    )
    if accelerator.is_main_process:
        print(message, file=sys.stderr, flush=True)
    raise TrainingInterrupted(signum, path, message)

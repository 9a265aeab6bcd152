"""The asynchronous rollout worker (``rollout.async_steps`` = k ≥ 1): a separate process with its own copy of
the policy and its own torch threads samples the batches of steps t+1 … t+k while the trainer updates on
step t. ``async_steps=0`` never builds it: the synchronous path is untouched.

Versions. The policy's version is the number of trainer steps done. Batch b is drawn by version
v(b) = max(v₀, b − k) exactly (v₀: the version the run started or resumed at), so it is trained k versions
after the policy that drew it, once the first k steps are past. The schedule is fixed, not "whatever weights
the worker has": the same seed gives the same samples however fast either side runs, and a resumed run
draws what the killed one would have (``save_queue`` / ``load_queue``).

Weights. The trainer publishes its trainable parameters into a shared-memory copy after each step
(``publish``); the worker copies them into its own model before a batch that needs the new version. A
version is overwritten only once the worker has taken it for every batch that asked for it, so neither
side ever reads a half-written or a newer version than the schedule says.

Failure. The worker sends a ``UserError`` back as its class and one line, any other exception with its
traceback; a worker that dies without a word (killed, out of memory) is noticed within a second by the
trainer waiting on it, which raises ``ProducerError`` naming it, its exit code and the last checkpoint.
The worker dies with the trainer (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import multiprocessing as mp
import queue
import signal
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.errors import UserError
from posttrain.rollout.sync import check_copy, named_fingerprint

QUEUE_FILE = "rollout_queue_{}.pt"
POLL_SECONDS = 0.5


class ProducerError(RuntimeError):
    """The asynchronous rollout worker failed or died; the run stops without writing anything further."""


@dataclass
class Request:
    """Batch ``batch``: ``n`` samples of each of ``prompts``, drawn by policy version ``version``."""

    batch: int
    prompts: list
    n: int
    version: int


def batch_seed(seed: int, process_index: int, batch: int) -> int:
    """The torch seed of one batch's sampling: a function of the run seed, the process and the batch only."""
    return (seed * 1_000_003 + process_index * 7_919 + batch) % (2**63)


def trainable_names(policy: torch.nn.Module) -> list[str]:
    """The parameters an update changes; the frozen ones (a LoRA policy's base) are sent once, at start."""
    return [name for name, p in policy.named_parameters() if p.requires_grad]


class Producer:
    """The trainer's handle on the worker: ``request`` batches ahead, ``take`` one when its step comes,
    ``publish`` the weights after each step, ``close`` at the end."""

    def __init__(
        self, policy, rollout_config, sampling, tokenizer_path, model_path, seed, process_index, start_version
    ):
        k = rollout_config.async_steps
        self.steps_ahead, self.start_version = k, start_version
        self.names = trainable_names(policy)
        # rollout.sync_check: the trainer's fingerprint of each version, compared with the worker's copy at `take`
        self.checking = rollout_config.sync_check_in_force == "fingerprint"
        self.expected = {start_version: named_fingerprint(policy, self.names)} if self.checking else {}
        self.checked: dict[int, dict] = {}  # batch → the worker's fingerprint of the weights that drew it
        context = mp.get_context("spawn")  # fork after torch's thread pools start is unsafe
        self.shared = _sampling_copy(policy).share_memory()
        # one writer each (the trainer, the worker) and no lock of their own: a worker killed while holding
        # a Value's lock would leave the trainer blocked on reading it
        self.version = context.Value("q", start_version, lock=False)  # the version in self.shared
        self.loaded = context.Value("q", -1, lock=False)  # the last batch the worker took its weights for
        self.lock = context.Lock()
        self.requests, self.results = context.Queue(), context.Queue()
        self.requested: dict[int, Request] = {}
        self.ready: dict[int, tuple] = {}  # batch → (rollout, producer seconds: idle, generate)
        self.process = context.Process(
            target=_produce,
            args=(self.shared, self.version, self.loaded, self.lock, self.requests, self.results),
            kwargs={
                "engine_config": rollout_config,
                "sampling": sampling,
                "tokenizer_path": tokenizer_path,
                "model_path": model_path,
                "seed": seed,
                "process_index": process_index,
                "threads": rollout_config.producer_threads,
                "names": self.names,
                "check": self.checking,
            },
            name=f"posttrain-producer-{process_index}",
            daemon=True,
        )
        with _main_module_hidden(), _stop_signals_ignored():
            self.process.start()
        self.last_checkpoint = "none yet"

    def version_of(self, batch: int) -> int:
        """v(b) = max(v₀, b − k): the policy version that draws batch ``batch``."""
        return max(self.start_version, batch - self.steps_ahead)

    def request(self, batch: int, prompts: list, n: int) -> None:
        request = Request(batch, prompts, n, self.version_of(batch))
        self.requested[batch] = request
        self.requests.put(request)

    def take(self, batch: int):
        """(rollout, its request, {"producer_idle": s, "producer_generate": s, "wait": s}) of ``batch``,
        waiting for it."""
        start = time.perf_counter()
        while batch not in self.ready:
            self._receive()
        rollout, times = self.ready.pop(batch)
        request = self.requested.pop(batch)
        if batch in self.checked:  # batches a resumed checkpoint saved were drawn by the killed run
            check_copy(self.process.name, self.expected, self.checked.pop(batch), request)
        return rollout, request, {**times, "wait": time.perf_counter() - start}

    def publish(self, policy, version: int) -> None:
        """Write ``policy``'s trainable weights as ``version``, once the worker has taken the version they
        replace for every batch requested of it."""
        old = self.version.value
        needing = [b for b, r in self.requested.items() if r.version <= old and b not in self.ready]
        while needing and self.loaded.value < max(needing):
            self._receive(block=False)
            self._check_alive()
            time.sleep(0.001)
        parameters = dict(policy.named_parameters())
        shared = dict(self.shared.named_parameters())
        while not self.lock.acquire(timeout=POLL_SECONDS):  # a worker killed holding it never releases it
            self._check_alive()
        try:
            with torch.no_grad():
                for name in self.names:
                    shared[name].copy_(parameters[name].detach().to(shared[name].device))
            if any(p.is_cuda for p in shared.values()):  # the copies are queued on the stream: done before the flag
                torch.cuda.synchronize()
            self.version.value = version
        finally:
            self.lock.release()
        if self.checking:
            self.expected[version] = named_fingerprint(policy, self.names)
            oldest = min([r.version for r in self.requested.values()] + [version])
            self.expected = {v: f for v, f in self.expected.items() if v >= oldest}

    def pending(self) -> list[int]:
        """Batches requested and not yet taken, in order."""
        return sorted(self.requested)

    def save_queue(self, folder: Path, process_index: int) -> None:
        """Every batch requested and not yet taken, as drawn (waiting for those still being drawn), to
        ``folder/rollout_queue_<process>.pt``: a resumed run trains on them instead of drawing them again
        with weights it no longer has."""
        for batch in self.pending():
            while batch not in self.ready:
                self._receive()
        torch.save(
            [(self.requested[b], self.ready[b][0]) for b in self.pending()],
            Path(folder) / QUEUE_FILE.format(process_index),
        )

    def load_queue(self, folder: Path, process_index: int, processes: int) -> None:
        """The batches a checkpoint's ``save_queue`` kept, ready to be taken; refused when the checkpoint's
        run had another number of processes (each one's queue holds its own prompts)."""
        saved = len(list(Path(folder).glob(QUEUE_FILE.format("*"))))
        if saved != processes:
            raise ProducerError(
                f"{folder} holds the asynchronous queues of {saved} process(es), this run has {processes}: "
                "resume it with the number of processes that wrote it"
            )
        self.last_checkpoint = str(folder)
        path = Path(folder) / QUEUE_FILE.format(process_index)
        for request, rollout in torch.load(path, weights_only=False, map_location="cpu"):
            self.requested[request.batch] = request
            self.ready[request.batch] = (rollout, {"producer_idle": 0.0, "producer_generate": 0.0})

    def close(self) -> None:
        if self.process.is_alive():
            self.requests.put(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _receive(self, block: bool = True) -> None:
        try:
            message = self.results.get(timeout=POLL_SECONDS) if block else self.results.get_nowait()
        except queue.Empty:
            self._check_alive()
            return
        if message[0] != "ok":
            self.close()
            self._raise_sent(message)
        _, batch, rollout, times, checked = message
        self.ready[batch] = (rollout, times)
        if checked is not None:
            self.checked[batch] = checked

    def _raise_sent(self, message: tuple) -> None:
        """The worker's failure: its ``UserError`` as it was (one line, its class where its message rebuilds
        it), anything else a ``ProducerError`` with the worker's traceback."""
        if message[0] == "user_error":
            _, kind, text = message
            try:
                error = kind(text)
            except TypeError:  # a subclass built from other arguments (DataError)
                error = UserError(text)
            raise error
        raise ProducerError(f"the rollout producer failed (last checkpoint: {self.last_checkpoint}):\n{message[1]}")

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            while True:  # what it sent before it ended: its traceback says more than its exit code
                try:
                    message = self.results.get_nowait()
                except queue.Empty:
                    break
                if message[0] != "ok":
                    self._raise_sent(message)
            code = self.process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise ProducerError(
                f"the rollout producer process {self.process.name} (pid {self.process.pid}) died ({how}) with "
                f"batches {self.pending()} outstanding; the run stops here. Last checkpoint: {self.last_checkpoint} "
                "(run.resume_from=latest continues from it)"
            )


def _sampling_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``policy`` for sampling, without what only training needs: gradient checkpointing's
    input-grad hook is a local function, which the spawned process cannot unpickle, and the copy never
    runs a backward."""
    shared = copy.deepcopy(policy).requires_grad_(False)
    for module in shared.modules():
        if getattr(module, "_require_grads_hook", None) is not None:  # transformers' enable_input_require_grads
            module.disable_input_require_grads()
        if getattr(module, "is_gradient_checkpointing", False):
            module.gradient_checkpointing_disable()
    return shared


@contextlib.contextmanager
def _main_module_hidden():
    """Start a spawned process without it importing the parent's ``__main__`` again: a user's script that
    calls ``train`` at top level, unguarded by ``if __name__ == "__main__"``, would otherwise run a second
    training inside the producer. Nothing the producer receives is defined in ``__main__``."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@contextlib.contextmanager
def _stop_signals_ignored():
    """SIGINT and SIGTERM ignored while the worker starts (an ignored signal stays ignored through exec):
    a job scheduler's SIGTERM to every process of the job must reach the trainer only, which finishes its
    step and checkpoints with the worker's help. The worker still dies with the trainer (PR_SET_PDEATHSIG)
    or at ``close``."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _produce(shared, version, loaded, lock, requests, results, **settings) -> None:
    """The worker's loop: for each request, wait for its version, take those weights, sample, send back."""
    try:
        _die_with_parent()
        for sig in (signal.SIGINT, signal.SIGTERM):  # the trainer's to handle: it checkpoints, then closes us
            signal.signal(sig, signal.SIG_IGN)
        torch.set_num_threads(settings["threads"])
        from posttrain.models import load_tokenizer
        from posttrain.rollout import build_engine
        from posttrain.runtime.sampling import sample

        model = copy.deepcopy(shared)
        names = settings["names"]  # the frozen rest came with the copy
        tokenizer = load_tokenizer(settings["tokenizer_path"])
        engine = build_engine(settings["engine_config"], model, tokenizer, settings["model_path"], settings["seed"])
        have = synced = -math.inf
        while True:
            idle_from = time.perf_counter()
            request = requests.get()
            if request is None:
                return
            while version.value < request.version:
                time.sleep(0.001)
            idle = time.perf_counter() - idle_from
            with lock:
                if have != request.version:
                    if version.value != request.version:  # the trainer waits for `loaded`: cannot happen
                        raise RuntimeError(
                            f"batch {request.batch} needs version {request.version}, found {version.value}"
                        )
                    own, source = dict(model.named_parameters()), dict(shared.named_parameters())
                    with torch.no_grad():
                        for name in names:
                            own[name].copy_(source[name])
                    have = request.version
                    checked = named_fingerprint(model, names) if settings["check"] else None
                loaded.value = request.batch
            if synced != have:  # a vLLM server gets the version's weights (hf and lean sample from `model`)
                engine.sync_weights(model)
                synced = have
            start = time.perf_counter()
            torch.manual_seed(batch_seed(settings["seed"], settings["process_index"], request.batch))
            rollout, _ = sample(engine, model, request.prompts, settings["sampling"], request.n)
            rollout.version = torch.full((len(rollout),), have, dtype=torch.long)
            times = {"producer_idle": idle, "producer_generate": time.perf_counter() - start}
            results.put(("ok", request.batch, rollout, times, checked))
    except UserError as err:  # the user's to fix (a weight sync that did not hold): one line, not a traceback
        results.put(("user_error", type(err), str(err)))
    except BaseException:
        results.put(("error", traceback.format_exc()))

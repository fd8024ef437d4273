"""Exact resume and crash safety.

The uninterrupted run, the run stopped at a checkpoint and resumed, and the run SIGKILLed while
writing a checkpoint and resumed from the last complete one must end with bitwise the same queue,
queue pointer, key encoder, query encoder and loss trajectory (CPU, one thread, deterministic).
"""

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from stop_at import StopAt

from hf_contrast import CheckpointError, momentum_at

SCRIPT = Path(__file__).parent / "crash" / "train.py"
spec = importlib.util.spec_from_file_location("crash_train", SCRIPT)
crash_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crash_train)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process."""
    out = tmp_path_factory.mktemp("reference")
    trainer = crash_train.build_trainer(str(out))
    trainer.train()
    return crash_train.final_state(trainer), crash_train.losses(trainer), out


def assert_same_state(state, ref_state):
    assert set(state) == set(ref_state)
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k


def test_resume_after_stop_is_exact(reference, tmp_path):
    ref_state, ref_losses, _ = reference
    interrupted = crash_train.build_trainer(str(tmp_path))
    interrupted.add_callback(StopAt(crash_train.SAVE_STEPS))  # stop right after the first checkpoint
    interrupted.train()
    assert interrupted.state.global_step == 3
    assert (tmp_path / "checkpoint-3").is_dir()
    resumed = crash_train.build_trainer(str(tmp_path))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert_same_state(crash_train.final_state(resumed), ref_state)
    got = crash_train.losses(resumed)
    assert {s: got[s] for s in range(4, 9)} == {s: ref_losses[s] for s in range(4, 9)}
    assert resumed.state.global_step == 8
    assert resumed.momentum_callback.last_momentum == momentum_at(7, 8, 0.9, "cosine")  # the schedule continued


def test_sigkill_while_saving_loses_only_unsaved_steps(reference, tmp_path):
    ref_state, ref_losses, _ = reference
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--kill-while-saving", "6"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL: no cleanup ran
    half = tmp_path / "checkpoint-6"
    assert (half / "model.safetensors").exists() and not (half / "trainer_state.json").exists()  # half-written
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        crash_train.build_trainer(str(tmp_path)).train(resume_from_checkpoint=str(half))
    resumed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--resume"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Skipping" in resumed.stderr and "checkpoint-6" in resumed.stderr  # it resumed from checkpoint-3
    assert_same_state(load_file(tmp_path / "final_state.safetensors"), ref_state)
    got = {int(k): v for k, v in json.loads((tmp_path / "losses.json").read_text()).items()}
    assert {s: got[s] for s in range(4, 9)} == {s: ref_losses[s] for s in range(4, 9)}


def test_a_checkpoint_damaged_after_it_was_marked_is_passed_over(reference, tmp_path, caplog):
    """checkpoint-6's model.safetensors cut in half after the run (a full disk, a copy that stopped): `last`
    resumes from checkpoint-3, saying why, and ends as the uninterrupted run; naming checkpoint-6 is refused."""
    ref_state, ref_losses, ref_dir = reference
    for step in (3, 6):
        shutil.copytree(ref_dir / f"checkpoint-{step}", tmp_path / f"checkpoint-{step}")
    weights = tmp_path / "checkpoint-6" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    with pytest.raises(CheckpointError) as error:
        crash_train.build_trainer(str(tmp_path)).train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert str(error.value) == (
        f"resume_from_checkpoint={str(tmp_path / 'checkpoint-6')!r} is damaged: model.safetensors is {size // 2:,} "
        f"bytes but its header says {size:,} (truncated). The last intact checkpoint beside it is "
        f"{tmp_path / 'checkpoint-3'}: resume from it.")
    caplog.set_level(logging.WARNING)
    resumed = crash_train.build_trainer(str(tmp_path))
    resumed.train(resume_from_checkpoint="last")
    assert any(r.getMessage() == f"Skipping {tmp_path / 'checkpoint-6'}: model.safetensors is {size // 2:,} bytes "
               f"but its header says {size:,} (truncated)" for r in caplog.records)
    assert_same_state(crash_train.final_state(resumed), ref_state)  # from checkpoint-3, steps 4-8 again
    got = crash_train.losses(resumed)
    assert {s: got[s] for s in range(4, 9)} == {s: ref_losses[s] for s in range(4, 9)}


def test_checkpoint_damage_reads_headers_and_sizes(reference, tmp_path):
    from hf_contrast.trainer.checkpointing import checkpoint_damage, last_complete_checkpoint

    _, _, ref_dir = reference
    folder = tmp_path / "checkpoint-6"
    shutil.copytree(ref_dir / "checkpoint-6", folder)
    assert checkpoint_damage(str(folder)) is None
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole + b"\0" * 10)  # a tail the header does not account for
    assert checkpoint_damage(str(folder)) == f"model.safetensors is {len(whole) + 10:,} bytes but its header says {len(whole):,} (extra bytes)"
    weights.write_bytes(b"\0" * len(whole))  # zero-filled: a header length of 0, no JSON
    assert "no readable JSON header" in checkpoint_damage(str(folder))
    weights.write_bytes(whole)
    optimizer = folder / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:-100])  # a torch zip without its central directory
    assert checkpoint_damage(str(folder)) == "optimizer.pt is not a whole torch file (its zip directory is missing: truncated)"
    optimizer.write_bytes(b"")  # an empty file, as a full disk leaves it
    assert checkpoint_damage(str(folder)).startswith("optimizer.pt is not a whole torch file")
    shutil.copytree(ref_dir / "checkpoint-6", tmp_path / "ok", dirs_exist_ok=True)
    (folder / "optimizer.pt").write_bytes((tmp_path / "ok" / "optimizer.pt").read_bytes())
    (folder / "trainer_state.json").write_text('{"global_step": 6')
    assert checkpoint_damage(str(folder)) == "trainer_state.json is unreadable (JSONDecodeError)"
    skipped = []
    assert last_complete_checkpoint(str(tmp_path), skipped) is None and skipped[0][0] == str(folder)


def test_checkpoint_missing_queue_or_key_encoder_is_refused(reference, tmp_path):
    _, _, ref_dir = reference
    checkpoint = ref_dir / "checkpoint-6"
    weights = load_file(checkpoint / "model.safetensors")
    broken = tmp_path / "checkpoint-6"
    broken.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    save_file({k: v for k, v in weights.items() if not k.startswith(("queue.", "key_encoder."))},
              broken / "model.safetensors")
    trainer = crash_train.build_trainer(str(tmp_path / "run"))
    with pytest.raises(CheckpointError, match=r"missing: key_encoder \(\d+ tensors\), queue \(5 tensors\)"):
        trainer.train(resume_from_checkpoint=str(broken))
    (broken / "model.safetensors").unlink()
    torch.save(weights, broken / "pytorch_model.bin")  # a pickle: never loaded
    with pytest.raises(CheckpointError, match="never loads pickled weights"):
        trainer.train(resume_from_checkpoint=str(broken))


def test_rotation_keeps_the_last_complete_checkpoint_until_the_new_one_is_marked(tmp_path, monkeypatch):
    """save_total_limit=1: a death after transformers wrote checkpoint-6 but before it was marked
    complete must leave checkpoint-3 (complete) on disk to resume from."""
    import hf_contrast.trainer.contrastive_trainer as trainer_module
    from hf_contrast import last_complete_checkpoint

    real_mark = trainer_module.mark_complete

    def die_at_6(folder):
        if folder.endswith("checkpoint-6"):
            raise KeyboardInterrupt("killed before the marker")
        real_mark(folder)

    monkeypatch.setattr(trainer_module, "mark_complete", die_at_6)
    trainer = crash_train.build_trainer(str(tmp_path))
    trainer.args.save_total_limit = 1
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / "checkpoint-6" / "trainer_state.json").exists()  # transformers' part was written
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    monkeypatch.setattr(trainer_module, "mark_complete", real_mark)
    resumed = crash_train.build_trainer(str(tmp_path))
    resumed.args.save_total_limit = 1
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 8
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-8"]  # rotated after marking

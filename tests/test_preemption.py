"""SIGTERM (preemption): a complete checkpoint at the end of the step, a stop, exit 143, and a resume from it that
ends bitwise as the uninterrupted run, with the DataLoader workers signalled too; and under ``torchrun`` when only one
process gets the signal (both agree on the step). Real processes and real signals (``tests/crash/train.py``)."""

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from hf_contrast.trainer.checkpointing import checkpoint_damage
from hf_contrast.trainer.preemption import PreemptionCallback

SCRIPT = Path(__file__).parent / "crash" / "train.py"
spec = importlib.util.spec_from_file_location("crash_train", SCRIPT)
crash_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crash_train)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
HINT = ("SIGTERM: stopped after step 5 of 8 with a complete checkpoint, {folder} (weights, queue, key encoder, "
        "optimizer, RNG). Resume with resume_from_checkpoint='last'")


def sigterm_run(out: Path, *flags: str, launcher: tuple = (), **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *launcher, str(SCRIPT), str(out), "--sigterm-in", "5", *flags], env=ENV,
                          capture_output=True, text=True, timeout=300, **popen)


def test_sigterm_saves_a_complete_checkpoint_stops_and_resumes_exactly(tmp_path, caplog):
    reference = crash_train.build_trainer(str(tmp_path / "reference"))
    reference.train()
    out = tmp_path / "preempted"
    # the whole process group signalled (as a container stop): the 2 DataLoader workers get it too;
    # start_new_session: the group is the run's, not pytest's
    run = sigterm_run(out, "--workers", "2", "--sigterm-group", start_new_session=True)
    assert run.returncode == 143, run.stderr[-3000:]  # 128 + SIGTERM, after the checkpoint
    assert HINT.format(folder=out / "checkpoint-5") in run.stderr and "Traceback" not in run.stderr
    assert "DataLoader worker" not in run.stderr  # the workers ignored it
    assert checkpoint_damage(str(out / "checkpoint-5")) is None  # marked complete, every file whole
    assert json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["global_step"] == 5
    assert not (out / "final_state.safetensors").exists()  # it stopped: nothing after train() ran
    caplog.set_level(logging.INFO)
    resumed = crash_train.build_trainer(str(out))  # no workers: the views are seeded per image, so equal
    resumed.train(resume_from_checkpoint="last")
    state, ref_state = crash_train.final_state(resumed), crash_train.final_state(reference)
    assert set(state) == set(ref_state) and all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    got, want = crash_train.losses(resumed), crash_train.losses(reference)
    assert {s: got[s] for s in (6, 7, 8)} == {s: want[s] for s in (6, 7, 8)}  # the steps after the signal
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler lives only as long as train()


def test_under_torchrun_one_signalled_process_stops_both_at_the_same_step(tmp_path):
    out = tmp_path / "o"
    env_launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    run = sigterm_run(out, "--sigterm-rank", "1", launcher=env_launcher)
    # rank 0 was never signalled: it stopped at step 5 because rank 1 was (torchrun lists the first to exit)
    assert run.returncode != 0 and "exitcode  : 143" in run.stderr, run.stderr[-4000:]
    assert run.stderr.count(HINT.format(folder=out / "checkpoint-5")) == 1  # said once, by rank 0
    assert checkpoint_damage(str(out / "checkpoint-5")) is None
    assert (out / "checkpoint-5" / "rank1_buffers.safetensors").exists()  # rank 1 wrote its part at step 5 too
    assert not (out / "checkpoint-6").exists()


def test_the_jit_checkpoint_of_transformers_gives_way(tmp_path):
    trainer = crash_train.build_trainer(str(tmp_path))
    trainer.args.enable_jit_checkpoint = True
    before = signal.getsignal(signal.SIGTERM)
    jit = type(trainer)(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset)
    callbacks = jit.callback_handler.callbacks
    assert not any(isinstance(c, JITCheckpointCallback) for c in callbacks)  # one path saves on SIGTERM
    assert sum(isinstance(c, PreemptionCallback) for c in callbacks) == 1
    assert signal.getsignal(signal.SIGTERM) == before  # transformers' handler, installed in __init__, taken back
    trainer.args.enable_jit_checkpoint, trainer.args.save_on_sigterm = False, False
    off = type(trainer)(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset)
    assert off.preemption is None and not any(isinstance(c, PreemptionCallback) for c in off.callback_handler.callbacks)


def test_a_second_sigterm_kills_as_without_the_handler_and_a_forked_worker_ignores_it():
    """Seen at the handler: the first SIGTERM only sets the flag; the second restores the default and re-sends;
    in a forked child (a DataLoader worker) the parent's handler does nothing."""
    parent = PreemptionCallback()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        signal.signal(signal.SIGTERM, parent._handler)  # as a forked worker inherits it
        os.kill(os.getpid(), signal.SIGTERM)
        if parent.requested:
            os._exit(12)
        callback = PreemptionCallback()  # this process's own
        signal.signal(signal.SIGTERM, callback._handler)
        os.kill(os.getpid(), signal.SIGTERM)
        code = 10 if callback.requested else 11
        os.kill(os.getpid(), signal.SIGTERM)  # the second: the default action, death by SIGTERM
        os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM

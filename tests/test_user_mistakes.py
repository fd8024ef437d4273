"""Issue 24's table, run as a new user would: ``training/pretrain.py`` through each mistake.

A mistake found before training stops before any step, names the flag, field or folder and the fix, and
changes nothing on disk; a mistake found during training keeps the last complete checkpoint and says where
it is; what the script prints is true and has nothing a user cannot act on."""

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch
import transformers
from safetensors.torch import save_file

from hf_contrast import ContrastiveTrainer, ContrastiveTrainingArguments, MoCoModel, two_view_dataset
from hf_contrast.models.configuration import MoCoConfig
from hf_contrast.trainer.checkpointing import COMPLETE_MARKER, CheckpointError

REPO = Path(__file__).resolve().parents[1]
# tiny and quick: a 0.37 M-parameter resnet at 32 px, 32 training digits, 100 held-out ones for the kNN
BASE = ["--backbone", "test_resnet", "--projection_hidden_dim", "32", "--projection_dim", "16",
        "--max_train_samples", "32", "--per_device_train_batch_size", "16", "--queue_size", "32",
        "--knn_every_n_steps", "0", "--knn_k", "5", "--dataloader_num_workers", "0", "--logging_steps", "1",
        "--test_split_size", "0.02", "--disable_tqdm", "True", "--report_to", "none"]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time: what "nothing touched" compares."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def fake_checkpoint(folder: Path, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
    if complete:
        (folder / "trainer_state.json").write_text("{}")
        (folder / COMPLETE_MARKER).write_text("complete\n")
    return folder


# --- 1. resume as documented -------------------------------------------------------------------------------

def test_resume_accepts_true_last_and_a_path(tmp_path):
    from hf_contrast.trainer.checkpointing import resume_target

    last = fake_checkpoint(tmp_path / "checkpoint-7")
    fake_checkpoint(tmp_path / "checkpoint-9", complete=False)  # half-written: never picked
    for value in (True, "true", "True", "last", "LAST"):
        assert resume_target(value, str(tmp_path)) == str(last)
    for value in (None, False, "false", "None", ""):
        assert resume_target(value, str(tmp_path)) is None
    assert resume_target(str(last), "elsewhere") == str(last)
    with pytest.raises(CheckpointError, match="is not a complete checkpoint") as error:  # the output_dir itself
        resume_target(str(tmp_path), "elsewhere")
    assert "checkpoint-7" in str(error.value) and "=True" not in str(error.value)  # no advice to do what was done
    with pytest.raises(CheckpointError, match="no complete checkpoint to resume from"):
        resume_target("last", str(tmp_path / "empty"))


def test_help_says_how_to_resume(pretrain, capsys):
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "`last` or `true` picks the last complete checkpoint-N of --output_dir" in text
    assert "--overwrite_output_dir" in text


@pytest.fixture
def tiny_trainer(digits, tmp_path):
    from hf_contrast import TwoViewAugmentation

    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=32, projection_hidden_dim=32, projection_dim=16,
                                 image_size=32))
    data = two_view_dataset(digits["train"].select(range(32)), TwoViewAugmentation.small_images(image_size=32))
    args = ContrastiveTrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=16,
                                        use_cpu=True, report_to="none", dataloader_num_workers=0)
    return ContrastiveTrainer(model=model, args=args, train_dataset=data)


def test_train_in_python_takes_the_same_words(tiny_trainer, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(transformers.Trainer, "train", lambda self, resume=None, *a, **k: seen.append(resume))
    last = fake_checkpoint(tmp_path / "run" / "checkpoint-7")
    for value in (True, "true", "True", "last"):
        tiny_trainer.train(resume_from_checkpoint=value)
    assert seen == [str(last)] * 4


def test_an_error_during_training_names_the_last_complete_checkpoint(tiny_trainer, tmp_path, monkeypatch):
    def crash(self, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(transformers.Trainer, "train", crash)
    last = fake_checkpoint(tmp_path / "run" / "checkpoint-7")
    cut = fake_checkpoint(tmp_path / "run" / "checkpoint-9") / "model.safetensors"  # marked, then truncated
    cut.write_bytes(cut.read_bytes()[:-3])
    with pytest.raises(RuntimeError) as error:
        tiny_trainer.train()
    note = "\n".join(getattr(error.value, "__notes__", []))
    assert str(last) in note and "resume_from_checkpoint last" in note and "checkpoint-9" not in note


# --- 1, 5, 8, 9: a run, a refused rerun, a resume, an overwrite --------------------------------------------

def test_run_rerun_resume_and_overwrite(pretrain, tmp_path, caplog, monkeypatch):
    out = tmp_path / "run"
    caplog.set_level(logging.INFO)
    pretrain.main(BASE + ["--max_steps", "2", "--save_steps", "2", "--output_dir", str(out)])
    card = (out / "encoder" / "README.md").read_text()
    assert "32 training images" in card and "(5,000)" not in card  # the images that trained it, not the corpus
    assert "| optimizer steps | 2 |" in card
    setup = [r for r in caplog.records if r.getMessage().startswith("Contrastive setup")]
    assert setup and setup[0].levelno == logging.INFO  # a description, not a warning
    assert any(r.getMessage().startswith("kNN evaluation (k=5)") for r in caplog.records)  # said before it runs

    before = tree(out)
    with pytest.raises(FileExistsError, match="previous run") as error:  # 5: same command again
        pretrain.main(BASE + ["--max_steps", "2", "--save_steps", "2", "--output_dir", str(out)])
    assert "--resume_from_checkpoint last" in str(error.value) and "--overwrite_output_dir" in str(error.value)
    assert tree(out) == before  # checkpoint-2, final/, encoder/ untouched

    loaded = []
    load = pretrain.ContrastiveTrainer._load_from_checkpoint
    monkeypatch.setattr(pretrain.ContrastiveTrainer, "_load_from_checkpoint",
                        lambda self, path, model=None: loaded.append(path) or load(self, path, model))
    pretrain.main(BASE + ["--max_steps", "3", "--output_dir", str(out), "--resume_from_checkpoint", "True"])  # 1
    assert loaded == [str(out / "checkpoint-2")]  # the string 'True' picked the last complete checkpoint
    assert "| optimizer steps | 3 |" in (out / "encoder" / "README.md").read_text()

    pretrain.main(BASE + ["--max_steps", "2", "--output_dir", str(out), "--overwrite_output_dir",
                          "--save_strategy", "no"])
    assert "| optimizer steps | 2 |" in (out / "encoder" / "README.md").read_text()  # replaced as asked


# --- 2. too little data for one step: refused before anything; shorter than a logging window: trains -------------

def test_a_run_of_zero_steps_is_refused_before_anything(pretrain, tmp_path, digits, capfd):
    folder = tmp_path / "images"
    for i, item in enumerate(digits["train"].select(range(20))):
        (folder / str(i % 2)).mkdir(parents=True, exist_ok=True)
        item["image"].save(folder / str(i % 2) / f"{i}.png")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="0 optimizer steps") as error:
        pretrain.main(BASE + ["--train_dir", str(folder), "--per_device_train_batch_size", "32", "--max_train_samples",
                              "100", "--output_dir", str(out), "--test_split_size", "0.2"])
    message = str(error.value)
    for part in ("16 training images", "--per_device_train_batch_size 32", "world size 1", "--dataloader_drop_last",
                 "--gradient_accumulation_steps 1", "--per_device_train_batch_size 16"):
        assert part in message, part
    assert not out.exists()
    assert "Downloading data" not in capfd.readouterr().err  # 9: a local folder is not downloaded


def test_a_train_dir_that_does_not_exist_or_holds_no_image_says_so(pretrain, tmp_path, capsys):
    """datasets' own text for both is "doesn't contain any data files": say which, on the command line as a flag."""
    from hf_contrast.cli import run_main

    def run(folder) -> str:
        with pytest.raises(SystemExit) as stop:
            run_main(pretrain.main, pretrain.build_parser(), ["--train_dir", str(folder), "--output_dir",
                                                              str(tmp_path / "out")])
        assert stop.value.code == 2
        return capsys.readouterr().err.split(": error: ", 1)[1]  # in-process, argparse's prog is pytest's

    missing = tmp_path / "no_such_folder"
    assert run(missing).startswith(f"--train_dir {missing} does not exist (no folder {missing}")
    empty = tmp_path / "empty"
    (empty / "cats").mkdir(parents=True)
    (empty / "cats" / "notes.txt").write_text("not an image")
    message = run(empty)
    assert f"--train_dir {empty}: no image found in {empty} or its subfolders" in message
    assert ".png, .jpg, .jpeg" in message and "TRAIN_DIR/CLASS/IMAGE.png" in message
    (empty / "cats" / "a.PNG").write_bytes(b"")  # an image by its extension, at any depth and any case: no refusal
    from hf_contrast.data.splits import check_image_folder
    check_image_folder(str(empty))
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_image_folder(str(empty / "cats" / "notes.txt"))
    assert not (tmp_path / "out").exists()


def test_a_corrupt_image_stops_before_training_or_is_skipped_and_counted(pretrain, tmp_path, digits):
    """Item 3: one JPEG cut in half in an image folder. Without --skip_bad_samples the run stops before any
    step naming the file; with it, the run trains, logs the count and states it in the model card."""
    folder = tmp_path / "images"
    for i, item in enumerate(digits["train"].select(range(48))):
        (folder / str(i % 2)).mkdir(parents=True, exist_ok=True)
        item["image"].convert("RGB").save(folder / str(i % 2) / f"{i}.jpg")
    bad = folder / "0" / "10.jpg"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    # 45 training images (the seeded split puts 10.jpg among them), 3 held out; 3 steps of 15 meet every image
    run = BASE + ["--train_dir", str(folder), "--max_train_samples", "100", "--per_device_train_batch_size", "15",
                  "--max_steps", "3", "--save_steps", "3", "--test_split_size", "0.05", "--knn_k", "2"]
    out = tmp_path / "refused"
    with pytest.raises(ValueError, match="10.jpg") as error:
        pretrain.main(run + ["--output_dir", str(out)])
    assert "--skip_bad_samples" in str(error.value) and not out.exists()  # nothing written, the fix named
    out = tmp_path / "skipped"
    pretrain.main(run + ["--output_dir", str(out), "--skip_bad_samples", "1"])
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["skipped_samples"] for h in state["log_history"] if "loss" in h][-1] == 1
    card = (out / "encoder" / "README.md").read_text()
    assert "| unreadable images skipped | 1 (each replaced by the next readable image) |" in card


def test_a_run_shorter_than_one_logging_window_trains_warns_and_logs_its_last_step(pretrain, tmp_path, caplog):
    # a --max_steps 2 smoke test under --logging_steps 10: transformers would train it and log nothing
    caplog.set_level(logging.WARNING)
    out = tmp_path / "o"
    results = pretrain.main(BASE + ["--max_steps", "2", "--logging_steps", "10", "--output_dir", str(out)])
    warned = [r.getMessage() for r in caplog.records if "fewer than one logging window" in r.getMessage()]
    assert len(warned) == 1 and "--logging_steps 2" in warned[0] and "logged once, at the last step" in warned[0]
    history = json.loads((out / "log_history.json").read_text())
    logged = [h for h in history if "loss" in h]
    assert [h["step"] for h in logged] == [2] and math.isfinite(logged[0]["loss"])  # the whole run's mean loss
    assert logged[0]["queue_fill"] == 1.0 and results["final_loss"] == logged[0]["loss"]  # the window's metrics too
    assert (out / "encoder" / "model.safetensors").exists()  # and it exported


def test_a_run_of_whole_logging_windows_logs_as_transformers_does(pretrain, tmp_path):
    # 3 steps under --logging_steps 2: step 2 only, no extra log at the end (the callback only fills a gap)
    out = tmp_path / "o"
    pretrain.main(BASE + ["--max_steps", "3", "--logging_steps", "2", "--output_dir", str(out)])
    history = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in history if "loss" in h] == [2]  # step 3 ends a partial window after a logged one


# --- 6, 7: flags --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["moco", "mocov3"])
def test_unknown_backbone_gets_the_configs_answer(pretrain, tmp_path, method):
    with pytest.raises(ValueError, match=r"backbone='resnet_18' is not a timm model name. Did you mean one of: resnet18"):
        pretrain.main(["--method", method, "--backbone", "resnet_18", "--output_dir", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="backbone='not_a_model' is not a timm model name"):
        pretrain.main(["--method", method, "--backbone", "not_a_model", "--output_dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_an_image_size_off_the_patch_grid_is_refused_or_padded(pretrain, tmp_path):
    """vit_tiny_patch16_224 at 30 px would train on a 1x1 grid: the top-left 16x16 pixels of each view."""
    with pytest.raises(ValueError) as error:
        pretrain.main(["--backbone", "vit_tiny_patch16_224", "--image_size", "30", "--output_dir", str(tmp_path / "o")])
    assert str(error.value).startswith("image_size=30 is not a multiple of the patch size 16 of "
                                       "backbone='vit_tiny_patch16_224': its 1x1 grid of patches would see only the "
                                       "top-left 16x16 pixels, dropping the last 14. Use image_size=16 or image_size=32")
    assert not (tmp_path / "o").exists()
    config = MoCoConfig(backbone="vit_tiny_patch16_224", image_size=30, queue_size=8, projection_hidden_dim=16,
                        projection_dim=8, backbone_kwargs=dict(img_size=30, dynamic_img_pad=True, dynamic_img_size=True))
    model = MoCoModel(config)  # padded to 32 px, as asked: a 2x2 grid
    assert model.encoder.patch_embed.dynamic_img_pad and model.encoder(torch.randn(2, 3, 30, 30)).shape == (2, 192)
    MoCoModel(MoCoConfig(backbone="vit_tiny_patch16_224", image_size=32, queue_size=8, projection_hidden_dim=16,
                         projection_dim=8, backbone_kwargs=dict(img_size=32)))  # a multiple: no refusal


def test_abbreviated_flags_are_errors(pretrain, tmp_path):
    with pytest.raises(ValueError, match="--learning_rat"):  # byol: old code took the flag and failed later
        pretrain.main(["--learning_rat", "0.1", "--method", "byol", "--output_dir", str(tmp_path)])


# --- 8. text that says something true --------------------------------------------------------------------------

def test_no_signal_label_names_the_methods_formula():
    from hf_contrast import MoCoV3Config, MoCoV3Model, SimCLRConfig, SimCLRModel
    from hf_contrast.report import no_signal_label

    tiny = dict(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32)
    assert no_signal_label(SimCLRModel(SimCLRConfig(**tiny))).startswith("ln(2N-1)")
    assert no_signal_label(MoCoV3Model(MoCoV3Config(**tiny))).startswith("4T x ln(N*W)")
    assert no_signal_label(MoCoModel(MoCoConfig(queue_size=64, **tiny))).startswith("ln(K+1)")


def test_a_streams_epoch_is_its_position():
    from types import SimpleNamespace

    from hf_contrast.trainer import StreamEpochCallback

    class Stream:  # 25 batches per epoch; 4 taken in epoch 1
        def state_dict(self):
            return {"epoch": 1, "batches": 4}

        def batches_per_epoch(self, epoch):
            return 25

    state = SimpleNamespace(epoch=1.0)  # what transformers sets: step / max_steps
    StreamEpochCallback(Stream()).on_step_end(None, state, None)
    assert state.epoch == pytest.approx(1.16)


def test_a_streamed_run_logs_the_epoch_it_reached(pretrain, digits, tmp_path):
    from hf_contrast import write_shards

    write_shards(digits["train"].select(range(384)), str(tmp_path / "shards"), images_per_shard=96)
    out = tmp_path / "out"
    pretrain.main(BASE + ["--dataset_name", "webdataset", "--data_files", str(tmp_path / "shards" / "*.tar"),
                          "--streaming", "True", "--knn_samples", "40", "--per_device_train_batch_size", "32",
                          "--max_steps", "3", "--save_steps", "3", "--output_dir", str(out)])
    history = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    epochs = [h["epoch"] for h in history if "loss" in h]
    assert epochs == pytest.approx([1 / 12, 2 / 12, 3 / 12], abs=1e-4)  # 32 of 384 images a step; old code: 1/3, 2/3, 1


def test_a_truncated_shard_is_named_before_training(pretrain, digits, tmp_path):
    """Item 4: a tar shard cut short used to stop the run at step 0 inside a DataLoader worker with
    tarfile's bare "unexpected end of data"."""
    from hf_contrast import write_shards

    write_shards(digits["train"].select(range(192)), str(tmp_path / "shards"), images_per_shard=48)
    bad = sorted((tmp_path / "shards").glob("*.tar"))[2]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=bad.name) as error:
        pretrain.main(BASE + ["--dataset_name", "webdataset", "--data_files", str(tmp_path / "shards" / "*.tar"),
                              "--streaming", "True", "--knn_samples", "20", "--per_device_train_batch_size", "16",
                              "--max_steps", "3", "--output_dir", str(out)])
    assert type(error.value).__name__ == "ShardError" and not (out / "checkpoint-1").exists()


# --- 9. noise ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU case")
def test_loader_defaults_fit_a_cpu():
    from hf_contrast.cli import fit_loader_to_device

    args = ContrastiveTrainingArguments(output_dir="unused")  # no CUDA here: neither pinning nor non-blocking
    assert not args.dataloader_pin_memory and not args.accelerator_config.non_blocking
    args = transformers.TrainingArguments(output_dir="unused", accelerator_config={"non_blocking": True})  # finetune.py
    assert args.dataloader_pin_memory and args.accelerator_config.non_blocking  # on a CPU: both warn
    fit_loader_to_device(args)
    assert not args.dataloader_pin_memory and not args.accelerator_config.non_blocking


def test_image_processor_of_an_export_loads_without_a_false_warning(tmp_path, capfd):
    from hf_contrast import export_encoder
    from hf_contrast.hub.export import load_image_processor

    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=32, projection_hidden_dim=32, projection_dim=16,
                                 image_size=32))
    export_encoder(model, tmp_path, mean=(0.5,) * 3, std=(0.25,) * 3)
    transformers.utils.logging.get_logger("x").warning_once.cache_clear()  # warning_once: once per process
    capfd.readouterr()
    processor = load_image_processor(tmp_path)
    assert type(processor).__name__ == "TimmWrapperImageProcessor"
    from PIL import Image

    pixels = processor(Image.new("RGB", (40, 40)), return_tensors="pt")["pixel_values"]
    assert tuple(pixels.shape) == (1, 3, 32, 32)  # the export's own preprocessing
    assert "Falling back" not in "".join(capfd.readouterr())


def test_torchrun_does_not_warn_about_broadcast_buffers(tmp_path):
    """torch >= 2.13 deprecates DDP's ``broadcast_buffers`` (which transformers passes as ``ddp_broadcast_buffers=False``
    through accelerate) and warned once per process; its replacement would broadcast rank 0's buffers at wrap time."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    argv = BASE + ["--use_cpu", "--per_device_train_batch_size", "8", "--max_train_samples", "64", "--max_steps", "2",
                   "--output_dir", str(tmp_path / "run")]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          str(REPO / "training" / "pretrain.py"), *argv], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "broadcast_buffers" not in run.stderr + run.stdout and "world size 2" in run.stdout


def test_license_is_an_spdx_string():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


# --- 10. a clone used without installing ------------------------------------------------------------------------

def test_a_missing_card_template_stops_the_run_before_training(pretrain, tmp_path, monkeypatch):
    def missing():
        raise FileNotFoundError("The model card template encoder_card.md.jinja is neither ...")

    monkeypatch.setattr(pretrain, "default_template_text", missing)
    with pytest.raises(FileNotFoundError, match="encoder_card.md.jinja"):
        pretrain.main(BASE + ["--max_steps", "2", "--output_dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()  # no step ran, nothing written


CLONE_RUN = textwrap.dedent("""
    import runpy, sys
    # As a clone on PYTHONPATH without `pip install`: drop setuptools' editable finder, which maps
    # hf_contrast.model_cards onto model_cards/ only for an installed copy.
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                        and "__editable__" not in type(f).__module__]
    import hf_contrast
    assert hf_contrast.__file__.startswith(sys.argv[1]), hf_contrast.__file__
    try:
        import hf_contrast.model_cards
        raise SystemExit("hf_contrast.model_cards is importable: this is not a clone without install")
    except ModuleNotFoundError:
        pass
    sys.argv = ["training/pretrain.py"] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def test_a_clone_without_install_exports_and_shows_its_logs(tmp_path):
    """The editable install's meta-path finder is dropped (as tests/test_wheel_install.py does for the wheel), so
    ``hf_contrast`` resolves to this checkout through PYTHONPATH and ``hf_contrast.model_cards`` does not exist:
    exactly a clone run with ``PYTHONPATH=.``. Old code trained, then died in the export."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    argv = [a for a in BASE if a not in ("--disable_tqdm", "True")] + ["--max_steps", "2", "--output_dir", str(out)]
    run = subprocess.run([sys.executable, "-c", CLONE_RUN, str(REPO), *argv], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "encoder" / "README.md").is_file()
    assert "INFO hf_contrast.trainer: Contrastive setup" in run.stdout  # INFO, and pretrain.py shows it
    logs = [line for line in run.stdout.splitlines() if line.startswith("{'loss': ")]
    assert logs and not logs[0].startswith("{'loss': '")  # numbers, not quoted strings
    assert "pin_memory" not in run.stderr and "non_blocking" not in run.stdout + run.stderr
    assert math.isfinite(json.loads((out / "results.json").read_text())["final_loss"])

"""Push and pull through the real huggingface_hub client over HTTP, against the Hub-compatible server
of ``hub_server.py`` on 127.0.0.1; and the errors that must lose nothing.

HF_ENDPOINT is read once when huggingface_hub is imported, and conftest sets HF_HUB_OFFLINE=1, so
the client side runs in a subprocess with ``HF_ENDPOINT`` pointing at the server and offline mode off.
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY
from hub_server import HubServer
from safetensors.torch import load_file
from test_hub_export import AUGMENTATION, EXPORT_FILES, shared_moco_run

from hf_contrast import HubPushError, MoCoConfig, MoCoModel, push_encoder_to_hub
from hf_contrast.hub.push import check_can_push

TOKEN = "hf_test_token"
REPO = "test-org/tiny-moco"


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def hub_env(hub: HubServer, tmp_path: Path, token: str | None = TOKEN) -> dict[str, str]:
    """Environment of a client process talking to ``hub``: its endpoint, a fresh cache, offline mode off."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    if token:
        env["HF_TOKEN"] = token
    return env


@pytest.fixture(scope="module")
def hub():
    with HubServer(token=TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """The shared briefly trained MoCo test_resnet: ``(model, export, run_dir, expected_features)``."""
    model, _, export, run_dir, expected = shared_moco_run(digits, tmp_path_factory)
    return model, export, run_dir, expected


CLIENT = textwrap.dedent(r'''
    """Client side: push with hf_contrast, then pull by repo id with timm, transformers and ModelCard."""
    import json, os, sys
    import timm, torch
    from huggingface_hub import ModelCard, hf_hub_download
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, AutoModelForImageClassification
    import hf_contrast

    export, full, repo = sys.argv[1], sys.argv[2], sys.argv[3]
    report = {}
    # 1. push an existing export folder: creates the repo
    report["first_commit"] = hf_contrast.push_encoder_to_hub(export, repo).oid
    # 2. push again from a model: updates the existing repo (a new card with a kNN result)
    model = hf_contrast.MoCoModel.from_pretrained(full)
    second = os.path.join(os.path.dirname(sys.argv[4]), "second_export")  # no trainer: no curves plot
    report["second_commit"] = hf_contrast.push_encoder_to_hub(
        model, repo, export_dir=second, augmentation=hf_contrast.TwoViewAugmentation.small_images(32, mean=(0.133,) * 3, std=(0.31,) * 3),
        knn_top1=0.1234, commit_message="update").oid
    # 3. an unreachable endpoint: a clear error, the export untouched
    try:
        hf_contrast.push_encoder_to_hub(export, repo, endpoint="http://127.0.0.1:9")
    except hf_contrast.HubPushError as e:
        report["unreachable"] = [str(e), str(e.export_dir)]
    try:
        hf_contrast.push_encoder_to_hub(export, repo, token="hf_wrong")
    except hf_contrast.HubPushError as e:
        report["bad_token"] = str(e)
    # 4. no token: the export made from the model is kept and its path given
    os.environ.pop("HF_TOKEN")
    try:
        hf_contrast.push_encoder_to_hub(model, repo)
    except hf_contrast.HubPushError as e:
        report["no_token"] = [str(e), str(e.export_dir), sorted(os.listdir(e.export_dir))]
    # 5. pull by repo id
    x = load_file(f"{export}/../expected.safetensors")["x"]
    with torch.no_grad():
        out = {"timm": timm.create_model(f"hf-hub:{repo}", pretrained=True).eval()(x),
               "auto": AutoModel.from_pretrained(repo)(x).pooler_output}
        classifier = AutoModelForImageClassification.from_pretrained(repo, num_labels=3)
        out["logits"] = classifier(x).logits
    save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[4])
    card = ModelCard.load(repo)
    report["card"] = {"library_name": card.data.library_name, "pipeline_tag": card.data.pipeline_tag,
                      "text": card.text}
    report["curves_size"] = os.path.getsize(hf_hub_download(repo, "training_curves.png", revision=report["first_commit"]))
    # 6. training/pretrain.py --push_to_hub, in this process (an interpreter start costs seconds)
    os.environ["HF_TOKEN"] = sys.argv[5]
    sys.path.insert(0, sys.argv[6])
    import pretrain
    report["pretrain"] = pretrain.main(sys.argv[7:])
    print(json.dumps(report))
''')


PRETRAIN_ARGS = ["--backbone", "test_resnet", "--projection_hidden_dim", "32", "--projection_dim", "16",
                 "--queue_size", "64", "--per_device_train_batch_size", "32",
                 "--num_train_epochs", "1", "--use_cpu", "--dataloader_num_workers", "0", "--disable_tqdm", "true",
                 "--save_strategy", "epoch", "--logging_steps", "1", "--knn_k", "20", "--report_to", "none",
                 "--push_to_hub", "--hub_model_id", "test-org/pretrained"]


def image_folder(digits, root: Path, per_class: int = 30, classes: int = 3) -> Path:
    """Real digits as a small ``imagefolder`` (loads in a fraction of the embedded dataset's time)."""
    counts = dict.fromkeys(range(classes), 0)
    for item in digits["train"]:
        label = item["label"]
        if label in counts and counts[label] < per_class:
            (root / str(label)).mkdir(parents=True, exist_ok=True)
            item["image"].save(root / str(label) / f"{counts[label]}.png")
            counts[label] += 1
        if all(c == per_class for c in counts.values()):
            return root
    raise AssertionError("not enough digits")


@pytest.fixture(scope="module")
def client(hub, trained, digits, tmp_path_factory):
    """Run :data:`CLIENT` once against the server; returns its report and the features it pulled."""
    tmp = tmp_path_factory.mktemp("client")
    images = image_folder(digits, tmp / "images")
    _, export, run_dir, _ = trained
    before = digest(export)
    script = tmp / "client.py"
    script.write_text(CLIENT)
    training = Path(__file__).resolve().parents[1] / "training"
    argv = [str(export), str(run_dir / "full"), REPO, str(tmp / "out.st"), TOKEN, str(training),
            *PRETRAIN_ARGS, "--train_dir", str(images), "--output_dir", str(tmp / "pretrain")]
    result = subprocess.run([sys.executable, str(script), *argv], env=hub_env(hub, tmp, token=TOKEN),
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    second_export = {p.name: p.read_bytes() for p in (tmp / "second_export").iterdir()}
    return report, load_file(tmp / "out.st"), before, tmp / "pretrain", second_export


def test_push_creates_then_updates_the_repo_with_the_export(hub, trained, client):
    export = trained[1]
    report = client[0]
    repo = hub.repos[REPO]
    assert len(repo.commits) == 3  # the empty repo, then two pushes
    assert report["first_commit"] != report["second_commit"] == repo.head[0]
    first = {p.name: p.read_bytes() for p in export.iterdir()}
    assert set(first) == EXPORT_FILES and repo.commits[1][1] == first  # first push: the trainer's export
    files, second = hub.files(REPO), client[4]
    assert "training_curves.png" not in second  # exported from a model: no training curves
    assert files == second  # the repo root holds exactly the second export: the stale plot was deleted
    assert b"0.1234" in files["README.md"] and b"0.1234" not in repo.commits[1][1]["README.md"]


def test_pull_by_repo_id_gives_the_trained_features_and_the_card(hub, trained, client):
    expected = trained[3]
    report, out = client[0], client[1]
    torch.testing.assert_close(out["timm"], expected["features_x"], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["auto"], expected["features_x"], atol=1e-5, rtol=0)
    assert out["logits"].shape == (4, 3)
    card = report["card"]
    assert card["library_name"] == "timm" and card["pipeline_tag"] == "image-feature-extraction"
    assert "**32 negatives**" in card["text"] and f'"hf-hub:{REPO}"' in card["text"]
    assert report["curves_size"] == len(hub.repos[REPO].commits[1][1]["training_curves.png"]) > 1000  # first push


def test_failed_pushes_say_what_to_change_and_lose_nothing(hub, trained, client):
    export = trained[1]
    report, before = client[0], client[2]
    message, where = report["unreachable"]
    assert "127.0.0.1:9" in message and str(export.resolve()) in message and Path(where) == export.resolve()
    assert digest(export) == before
    assert "401" in report["bad_token"] and "write access" in report["bad_token"]
    assert len(hub.repos[REPO].commits) == 3  # neither failure committed anything
    message, where, kept = report["no_token"]
    assert "no Hugging Face token" in message and "HF_TOKEN" in message and where in message
    assert {"config.json", "model.safetensors", "README.md"} <= set(kept)


def test_pretrain_pushes_the_encoder_export_not_the_checkpoint(hub, client):
    """``training/pretrain.py --push_to_hub``: the repo gets the export only (the Trainer's own push of
    the full checkpoint is disabled); the local export and the full checkpoint both stay."""
    results, out = client[0]["pretrain"], client[3]
    assert set(hub.files("test-org/pretrained")) == EXPORT_FILES  # no checkpoint-*, final/, training_args.bin
    assert len(hub.repos["test-org/pretrained"].commits) == 2  # one push
    assert (out / "encoder" / "model.safetensors").is_file() and (out / "final" / "model.safetensors").is_file()
    readme = hub.files("test-org/pretrained")["README.md"].decode()
    assert f"**{results['knn_pretrained']:.4f}**" in readme and "raw pixels" in readme


@pytest.mark.parametrize("repo_id", ["", "bad repo/name", "org/na me", "a/b/c", "org/" + "x" * 100])
def test_malformed_repo_id_is_refused_before_anything_is_written(repo_id, tmp_path):
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=8, **TINY))
    with pytest.raises(ValueError, match="hub_model_id|repo id"):
        push_encoder_to_hub(model, repo_id, token=TOKEN, export_dir=tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_offline_mode_keeps_the_export_and_names_it(trained, tmp_path):
    # conftest sets HF_HUB_OFFLINE=1 for the test process
    model = trained[0]
    with pytest.raises(HubPushError, match="HF_HUB_OFFLINE") as error:
        push_encoder_to_hub(model, REPO, token=TOKEN, export_dir=tmp_path / "export", augmentation=AUGMENTATION)
    assert str((tmp_path / "export").resolve()) in str(error.value)
    assert error.value.export_dir == tmp_path / "export"
    assert set(os.listdir(tmp_path / "export")) >= {"config.json", "model.safetensors", "README.md"}
    assert isinstance(error.value, ValueError)


def test_push_refuses_a_non_empty_export_dir(trained, tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        push_encoder_to_hub(trained[0], REPO, token=TOKEN, export_dir=tmp_path)
    assert os.listdir(tmp_path) == ["mine.txt"]


def test_check_can_push_fails_fast():
    with pytest.raises(ValueError, match="not a valid Hub repo id"):
        check_can_push("not a repo", token=TOKEN)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        check_can_push(REPO, token=TOKEN)  # conftest: offline


def test_push_refuses_a_folder_that_is_not_an_export(tmp_path):
    with pytest.raises(ValueError, match="not an encoder export"):
        push_encoder_to_hub(tmp_path, REPO, token=TOKEN)

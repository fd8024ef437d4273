"""A wheel install exports encoders: the model card template ships as package data.

Builds the wheel the way a user's ``pip install .`` would, unpacks it onto a bare ``PYTHONPATH`` (no
source tree, the editable install's finder removed) and runs an export there, from a directory
outside the repository."""

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "hf_contrast/model_cards/encoder_card.md.jinja"

EXPORT_SCRIPT = textwrap.dedent("""
    import sys
    # Drop setuptools' editable finder: only the unpacked wheel may provide hf_contrast.
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
                        and "__editable__" not in type(f).__module__]
    from pathlib import Path
    import hf_contrast
    from hf_contrast import MoCoConfig, MoCoModel, export_encoder
    site = Path(sys.argv[1]).resolve()
    assert Path(hf_contrast.__file__).resolve().is_relative_to(site), hf_contrast.__file__
    import hf_contrast.model_cards as cards
    assert Path(cards.__file__).resolve().is_relative_to(site), cards.__file__
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, projection_hidden_dim=32,
                                 projection_dim=16, image_size=32))
    export_encoder(model, "export", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    print(Path("export/README.md").read_text())
""")


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory):
    """The project's wheel, built without build isolation (no download) from a fresh copy of the sources
    (a ``build/`` folder left in the tree by an earlier build would leak stale files in), unpacked."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    for name in ("hf_contrast", "model_cards"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out / "dist"), str(source)], check=True, cwd=out)
    wheels = list((out / "dist").glob("hf_contrast-*.whl"))
    assert len(wheels) == 1, wheels
    site = out / "site"
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        wheel.extractall(site)
    return site, names


def test_wheel_ships_the_template_and_no_tests(unpacked_wheel):
    _, names = unpacked_wheel
    assert TEMPLATE in names
    assert "hf_contrast/model_cards/__init__.py" in names
    assert not any(n.startswith(("tests/", "training/", "model_cards/")) for n in names)


def test_export_from_the_unpacked_wheel_writes_the_card(unpacked_wheel, tmp_path):
    site, _ = unpacked_wheel
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, str(site)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    card = result.stdout
    assert "library_name: timm" in card
    assert "**64 negatives**" in card and "| negatives per anchor | 64 |" in card, card[:3000]
    assert (tmp_path / "export" / "model.safetensors").is_file()

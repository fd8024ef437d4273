import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: threads cost more than they give, and runs stay deterministic

# Tiny real timm models: test_resnet has BatchNorm, test_vit has LayerNorm; both run at 32x32.
TINY = dict(projection_hidden_dim=32, projection_dim=16, image_size=32)


@pytest.fixture(scope="session")
def digits():
    from hf_contrast import load_default_dataset

    return load_default_dataset()


@pytest.fixture(scope="session")
def pretrain():
    """``training/pretrain.py`` imported as the module ``pretrain`` (its ``main(argv)`` runs the script)."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pretrain", Path(__file__).parents[1] / "training" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module

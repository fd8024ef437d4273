"""training/pretrain.py turns device augmentation on by default when it trains on CUDA; the flag overrides."""

import pytest
import torch
from transformers import HfArgumentParser


def parse(pretrain, argv):
    parser = HfArgumentParser((pretrain.ModelArguments, pretrain.DataArguments, pretrain.ContrastiveTrainingArguments))
    parser.set_defaults(**pretrain.TRAINING_DEFAULTS)
    return parser.parse_args_into_dataclasses(args=argv + ["--output_dir", "unused"])[2]


@pytest.mark.parametrize("cuda", [False, True])
def test_device_augmentation_is_on_by_default_on_cuda_and_the_flag_overrides(pretrain, monkeypatch, cuda):
    default, on_cpu = parse(pretrain, []), parse(pretrain, ["--use_cpu", "True"])
    assert default.device_augmentation is None  # not given: decided from the device
    assert parse(pretrain, ["--device_augmentation", "False"]).device_augmentation is False
    assert parse(pretrain, ["--device_augmentation"]).device_augmentation is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)  # after parsing: TrainingArguments would init CUDA
    assert pretrain.device_augmentation_default(default) is cuda
    assert pretrain.device_augmentation_default(on_cpu) is False

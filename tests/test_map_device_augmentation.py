"""Device augmentation for a map-style dataset (a ``datasets.Dataset`` of images): uint8 items with
their view parameters, the views made in the trainer's step, exact resume into epoch 2."""

import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from stop_at import StopAt

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    DeviceAugmentation,
    MoCoConfig,
    MoCoModel,
    TwoViewAugmentation,
    augment,
    two_view_dataset,
)
from hf_contrast.data import square_resized

IMAGES, BATCH = 24, 8  # 3 steps an epoch


def test_items_are_uint8_images_with_the_views_parameters(digits):
    augmentation = TwoViewAugmentation.small_images(32)
    ds = two_view_dataset(digits["train"].select(range(8)), augmentation).configure_device_augmentation()
    assert ds.source_size == 37  # 32 * 8 / 7
    items = ds.__getitems__([3, 1])
    assert set(items[0]) == {"images", "view_params", "instance_id"} and int(items[1]["instance_id"]) == 1
    assert items[0]["images"].shape == (3, 37, 37) and items[0]["images"].dtype == torch.uint8
    assert items[0]["view_params"].shape == (2, augment.NUM_PARAMS) == (2, 13) and items[0]["view_params"].dtype == torch.float32
    reference = torch.from_numpy(np.array(square_resized(digits["train"][3]["image"], 37))).permute(2, 0, 1)
    assert torch.equal(items[0]["images"], reference)
    again = ds.__getitems__([3, 1])
    assert torch.equal(again[0]["view_params"], items[0]["view_params"])  # (seed, epoch, indices) fix the views
    ds.set_epoch(1)
    assert not torch.equal(ds.__getitems__([3, 1])[0]["view_params"], items[0]["view_params"])
    batch = torch.utils.data.default_collate(items)  # what the trainer's DataLoader gives
    v1, v2 = DeviceAugmentation(augmentation)(batch["images"], batch["view_params"])
    assert v1.shape == v2.shape == (2, 3, 32, 32) and not torch.equal(v1, v2)


class RecordingTrainer(ContrastiveTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append({k: tuple(v.shape) for k, v in inputs.items() if torch.is_tensor(v)})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def build(digits, out_dir, max_steps, save_steps, device_augmentation=True):
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32,
                                 queue_size=40, momentum=0.9))
    args = ContrastiveTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=max_steps, learning_rate=0.05, optim="sgd",
        optim_args="momentum=0.9", logging_steps=1, save_strategy="steps", save_steps=save_steps, use_cpu=True,
        disable_tqdm=True, seed=0, report_to="none", device_augmentation=device_augmentation)
    train = two_view_dataset(digits["train"].select(range(IMAGES)), TwoViewAugmentation.small_images(32))
    trainer = RecordingTrainer(model=model, args=args, train_dataset=train)
    trainer.seen = []
    return trainer


def state(trainer):
    out = {"queue": trainer.model.queue.keys, "queue_ids": trainer.model.queue.instance_ids}
    out.update({f"model.{k}": v for k, v in trainer.model.state_dict().items()})
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def test_trainer_makes_the_views_on_the_device_for_a_map_style_dataset(digits, tmp_path):
    trainer = build(digits, str(tmp_path), max_steps=2, save_steps=10)
    trainer.train()
    assert trainer.train_dataset.device_augmentation  # switched by the trainer
    assert trainer.seen == [{"pixel_values": (BATCH, 3, 32, 32), "pixel_values_2": (BATCH, 3, 32, 32),
                             "instance_id": (BATCH,)}] * 2
    made = trainer._device_augmentation
    assert isinstance(made, DeviceAugmentation) and made.augmentation is trainer.train_dataset.augmentation
    assert all(torch.isfinite(v).all() for v in state(trainer).values() if v.is_floating_point())


def test_resume_in_epoch_2_is_exact_with_device_augmentation(digits, tmp_path):
    max_steps, stop = 8, 4  # 3 steps an epoch: stop one step into epoch 2
    full = build(digits, str(tmp_path / "full"), max_steps, save_steps=max_steps)
    full.train()
    save_file(state(full), str(tmp_path / "full.safetensors"))
    run = str(tmp_path / "run")
    interrupted = build(digits, run, max_steps, save_steps=stop)
    interrupted.add_callback(StopAt(stop))
    interrupted.train()
    resumed = build(digits, run, max_steps, save_steps=stop)
    resumed.train(resume_from_checkpoint=os.path.join(run, f"checkpoint-{stop}"))
    assert resumed.state.global_step == max_steps
    save_file(state(resumed), str(tmp_path / "resumed.safetensors"))
    a, b = load_file(tmp_path / "full.safetensors"), load_file(tmp_path / "resumed.safetensors")
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert set(a) == set(b) and not different, f"differ after resume: {different[:3]}"

"""A method defined here, outside the package, trains, checkpoints, resumes exactly and exports with
``ContrastiveTrainer`` through the method interface alone (``ContrastivePreTrainedModel``): the trainer,
the EMA callback, the queue bookkeeping, the checkpoint checks, the export and the model card know no
model class.

The method: InfoNCE of a query against a momentum encoder's keys, with the other keys of the batch and a
FIFO queue of earlier keys as negatives (unused queue slots masked).
"""

import copy
import json

import timm
import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from safetensors.torch import load_file
from stop_at import StopAt

from hf_contrast import (
    ContrastiveConfig,
    ContrastiveOutput,
    ContrastivePreTrainedModel,
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    NegativeQueue,
    export_encoder,
    momentum_at,
)
from hf_contrast.models.backbone import build_encoder_and_head

TINY = dict(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32)


@strict(accept_kwargs=True)
class QueueInfoNCEConfig(ContrastiveConfig):
    model_type = "test_queue_infonce"
    queue_size: int = 48
    momentum: float = 0.9
    momentum_schedule: str = "constant"

    def nominal_negatives(self, per_device_batch_size, world_size=1):
        return None if per_device_batch_size is None else per_device_batch_size * world_size - 1 + self.queue_size


class QueueInfoNCEModel(ContrastivePreTrainedModel):
    config_class = QueueInfoNCEConfig
    method_name = "queue InfoNCE"

    def __init__(self, config):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        self.key_encoder, self.key_projector = copy.deepcopy(self.encoder), copy.deepcopy(self.projector)
        self.freeze_key_side()
        self.queue = NegativeQueue(config.queue_size, config.projection_dim)
        self.post_init()

    def key_modules(self):
        return (self.key_encoder, self.key_projector)

    def forward(self, pixel_values, pixel_values_2, instance_ids=None, return_loss=True):
        q = F.normalize(self.projector(self.encoder(pixel_values)).float(), dim=1)  # (B, D)
        with torch.no_grad():
            k = F.normalize(self.key_projector(self.key_encoder(pixel_values_2)).float(), dim=1)  # (B, D)
        queue = self.queue.keys.clone()  # (K, D), whole buffer: a copy, as the trainer enqueues in place after the loss
        batch_logits = q @ k.T  # (B, B): the positive on the diagonal
        queue_logits = (q @ queue.T).masked_fill(~self.queue.valid()[None, :], float("-inf"))  # (B, K)
        logits = torch.cat([batch_logits, queue_logits], 1) / self.config.temperature  # (B, B + K)
        labels = torch.arange(q.shape[0], device=q.device)  # (B,)
        return ContrastiveOutput(loss=F.cross_entropy(logits, labels), logits=logits, labels=labels, embeddings=q,
                                 queue_keys=k, num_negatives=torch.isfinite(logits).sum(1).float().mean() - 1)


def images(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 32, 32, generator=g)
    return [{"pixel_values": x[i], "pixel_values_2": (x[i] + 0.05 * torch.randn(3, 32, 32, generator=g))}
            for i in range(n)]


def trainer_for(out, max_steps=6, callbacks=()):
    torch.manual_seed(0)
    model = QueueInfoNCEModel(QueueInfoNCEConfig(**TINY))
    args = ContrastiveTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=8, max_steps=max_steps, learning_rate=0.05,
        logging_steps=1, save_steps=3, save_strategy="steps", use_cpu=True, report_to="none", seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    return ContrastiveTrainer(model=model, args=args, train_dataset=images(), callbacks=list(callbacks))


def state(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_a_method_defined_outside_the_package_trains_through_the_interface(tmp_path):
    trainer = trainer_for(tmp_path / "run")
    model = trainer.model
    assert trainer.negatives_per_anchor() == 8 - 1 + 48 and trainer.momentum_callback is not None
    key_before = [p.clone() for p in model.key_parameters()]
    query_before = [p.clone() for p in model.query_parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # the queue: 8 keys per step enqueued after each loss, 6 steps fill all 48 slots
    assert [h["queue_fill"] for h in logs] == [8 * (i + 1) / 48 for i in range(6)]
    # the negatives each forward saw: the other 7 keys of the batch, plus the keys queued by the earlier steps
    assert [h["num_negatives"] for h in logs] == [7 + 8 * i for i in range(6)] and model.queue_filled == 48
    assert all(h["momentum"] == 0.9 for h in logs)
    # the EMA ran once per step: the key side moved, and no gradient reached it
    assert not any(p.requires_grad for p in model.key_parameters())
    assert all(not torch.equal(a, b) for a, b in zip(key_before, model.key_parameters(), strict=True))
    # the EMA arithmetic of the shared implementation, exactly, on a copy
    twin = copy.deepcopy(model)
    k0 = [p.clone() for p in twin.key_parameters()]
    twin.momentum_update(momentum_at(0, 6, 0.9))
    for k_new, k_old, q in zip(twin.key_parameters(), k0, twin.query_parameters(), strict=True):
        torch.testing.assert_close(k_new, 0.9 * k_old + 0.1 * q, rtol=0, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(query_before, model.query_parameters(), strict=True))


def test_a_method_defined_outside_the_package_resumes_exactly_and_exports(tmp_path):
    reference = trainer_for(tmp_path / "ref")
    reference.train()
    stopped = trainer_for(tmp_path / "resumed", callbacks=[StopAt(3)])
    stopped.train()
    assert stopped.state.global_step == 3
    resumed = trainer_for(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint="last")
    ref, got = state(reference), state(resumed)
    assert set(ref) == set(got) and any(k.startswith("queue.") for k in ref)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert resumed.model.queue.pointer == reference.model.queue.pointer

    export = export_encoder(resumed, tmp_path / "export")
    encoder = timm.create_model(json.loads((export / "config.json").read_text())["architecture"], pretrained=False,
                                num_classes=0)
    encoder.load_state_dict(load_file(export / "model.safetensors"))
    encoder.eval()
    resumed.model.eval()
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(encoder(x), resumed.model.encoder(x))
    card = (export / "README.md").read_text()
    assert "queue InfoNCE" in card and "55 negatives" in card

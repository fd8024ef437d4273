"""What every contrastive method shares: the output dataclass and :class:`ContrastivePreTrainedModel`, whose
method interface is all that :class:`~hf_contrast.ContrastiveTrainer`, the monitors, the export and the model
card ask of a model (they check no model class). A new method subclasses it, sets what differs from the
defaults, and trains, checkpoints, resumes and exports with the package unchanged (tests/test_new_method.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration import ContrastiveConfig
from .momentum import model_ema_update_
from .negatives import negatives_per_anchor
from .queue import NegativeQueue


@dataclass
class ContrastiveOutput(ModelOutput):
    """Output of a contrastive model's forward.

    Attributes:
        loss: the contrastive loss (``None`` when ``return_loss=False``).
        logits: float32 similarities / temperature, one row per anchor. MoCo: ``(A, 1 + K)`` with
            the positive in column 0; SimCLR: ``(2N, 2M)`` with each anchor's own entry ``-inf``.
        labels: the column of each anchor's positive, ``(A,)``.
        embeddings: the anchors' projections (before normalisation), ``(A, D)``.
        queue_keys: MoCo only: L2-normalised keys to enqueue after the loss, ``(B, D)``. (Not
            ``keys``: a ``ModelOutput`` is a dict, and a field named ``keys`` would shadow
            ``dict.keys``, which DDP's output handling calls.)
        num_negatives: negatives per anchor actually used by this forward: an int when nothing can be
            masked (SimCLR, MoCo v3 without a queue, without FNC), else a 0-d device tensor, the mean per
            anchor after masking (unused queue slots, same-instance keys, FNC); always a tensor with a
            queue (its fill count is on the device).
        negative_counts: ``(A,)`` non-positive candidates left in each row, i.e. finite logits but the
            positive's (``None``: all but the positive and, SimCLR, the anchor itself); with
            ``false_negatives="attract"`` they include the attracted candidates. Always set with a queue.
        queue_instance_ids: MoCo only: instance ids ``(B,)`` of ``queue_keys`` (``None``: unknown).
        false_negatives_removed: ``(A,)`` candidates FNC took per anchor (``None`` when off).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    queue_keys: torch.Tensor | None = None
    num_negatives: int | torch.Tensor | None = None
    negative_counts: torch.Tensor | None = None
    queue_instance_ids: torch.Tensor | None = None
    false_negatives_removed: torch.Tensor | None = None


class ContrastivePreTrainedModel(PreTrainedModel):
    """Base of the contrastive models: a timm ``encoder`` and a ``projector`` head, and the method interface.

    Weights are initialised by timm and torch at construction; transformers' generic initialiser
    is not applied on top (it would overwrite timm's per-architecture init).

    The method interface (defaults: an in-batch method without momentum encoder or queue). A method's
    ``forward(pixel_values, pixel_values_2, instance_ids=None)`` returns a :class:`ContrastiveOutput`; then:

    - **a queue**: an attribute ``queue`` holding a :class:`~hf_contrast.models.queue.NegativeQueue` makes
      :attr:`has_queue` True; the trainer gathers ``outputs.queue_keys`` (and ``queue_instance_ids``) over the
      processes after the loss and calls :meth:`enqueue`; :attr:`queued_views` says how many keys per image
      enter (1, or 2 when both views are queued). The enqueue writes the buffer in place after the loss and
      before the backward: the forward must not let autograd save ``queue.keys`` itself (use a function of it,
      e.g. its normalisation as MoCo does, or a copy), and must mask the slots ``queue.valid()`` marks unused.
    - **a momentum encoder**: :meth:`key_modules` returns the EMA side (frozen at construction and after
      ``from_pretrained`` by :meth:`freeze_key_side`), :meth:`query_modules` the modules it follows; the
      trainer then calls :meth:`momentum_update` once per optimizer step with the momentum of
      ``config.momentum`` / ``config.momentum_schedule`` at step ``global_step + momentum_schedule_offset``.
    - **negatives**: :meth:`negatives_per_anchor` (from ``config.nominal_negatives``), :meth:`check_training_setup`
      (clear errors before the first step), :meth:`explain_negatives` (the model card's paragraph),
      :attr:`in_batch_negatives` (the trainer warns that gradient accumulation adds none and that
      ``gather_distributed=False`` sees only the device's batch), :attr:`loss_scale` (the no-signal loss is
      ``loss_scale * ln(K + 1)``) and :attr:`method_name` (logs and card).
    """

    method_name: str | None = None  # "MoCo", "SimCLR"...: the logs and the model card (None: the class name)
    in_batch_negatives: bool = True  # negatives from the (gathered) batch; False: only from a queue (MoCo v2)
    momentum_schedule_offset: int = 0  # the EMA after optimizer step i uses the momentum of step i + offset
    encode_keys_normalized: bool = False  # encode_keys() gives keys as queued: the queue monitors can re-encode them

    config_class = ContrastiveConfig
    base_model_prefix = "encoder"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    model_tags = ["hf_contrast", "timm"]
    accepts_loss_kwargs = False
    _no_split_modules = []

    def _init_weights(self, module):
        if hasattr(module, "init_non_persistent_buffers"):  # e.g. timm's relative position tables
            module.init_non_persistent_buffers()

    def get_input_embeddings(self):
        return None

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pooled backbone features of images ``(B, 3, H, W)`` -> ``(B, num_features)``: what
        downstream tasks (kNN, linear probe, fine-tuning) use."""
        return self.encoder(pixel_values)

    # --- the method interface -------------------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, pixel_values_2: torch.Tensor | None = None,
                instance_ids: torch.Tensor | None = None, return_loss: bool = True, **kwargs) -> ContrastiveOutput:
        """The method's contrastive forward (each method defines it).

        Args:
            pixel_values: first views ``(B, C, H, W)``.
            pixel_values_2: second views ``(B, C, H, W)``; required for the loss.
            instance_ids: ``(B,)`` long, the dataset index of each image (``TwoViewDataset`` items carry it as
                ``instance_id``); methods with a queue store them with the keys and may mask a query's own
                image. ``None``: unknown.
            return_loss: compute the loss.
        """
        raise NotImplementedError(f"{type(self).__name__} must define forward(pixel_values, pixel_values_2, ...)")

    @property
    def has_queue(self) -> bool:
        """Whether the model keeps a queue of earlier keys (an attribute ``queue``, a ``NegativeQueue``)."""
        return isinstance(getattr(self, "queue", None), NegativeQueue)

    @property
    def queue_filled(self) -> int:
        """How many queue slots hold real keys (host int; 0 without a queue)."""
        return self.queue.num_filled if self.has_queue else 0

    @property
    def queued_views(self) -> int:
        """Keys per image enqueued each step: 1 (the second view's), 2 when both views' keys are queued."""
        return 1

    @property
    def loss_scale(self) -> float:
        """``loss = loss_scale * cross-entropy``: with no signal the loss sits at ``loss_scale * ln(K + 1)``."""
        return 1.0

    def query_modules(self) -> tuple[nn.Module, ...]:
        """The trained modules a momentum encoder follows (by default the encoder and the projector)."""
        return (self.encoder, self.projector)

    def key_modules(self) -> tuple[nn.Module, ...]:
        """The momentum (EMA) side, module for module like :meth:`query_modules`; empty: no momentum encoder."""
        return ()

    @property
    def has_momentum_encoder(self) -> bool:
        return len(self.key_modules()) > 0

    def query_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.query_modules() for p in m.parameters()]

    def key_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.key_modules() for p in m.parameters()]

    def freeze_key_side(self) -> None:
        """No gradient into the momentum side (called at construction and again after ``from_pretrained``,
        whose loader materialises fresh parameters)."""
        for p in self.key_parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def momentum_update(self, momentum: float) -> None:
        """``theta_k <- momentum * theta_k + (1 - momentum) * theta_q`` for every key-side parameter (one fused
        foreach update; the pair lists are built once). Call once per optimizer step; BatchNorm buffers are
        not averaged."""
        if not self.has_momentum_encoder:
            raise ValueError(f"{type(self).__name__} has no momentum encoder (key_modules() is empty)")
        model_ema_update_(self, momentum)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, instance_ids: torch.Tensor | None = None, step: int = -1,
                check_finite: bool = True, accept: torch.Tensor | None = None) -> None:
        """Write keys ``(B, D)`` and their instance ids ``(B,)`` into the queue, FIFO with wrap-around.
        Keys and ids must be the same on every process (gather them first, see
        :func:`hf_contrast.distributed.gather_no_grad`); ``step`` is recorded as their entry step.

        ``check_finite`` drops NaN/inf keys, which would poison every later loss. It is the one
        host-device sync left here (a data-dependent shape); the trainer passes False and instead
        ``accept``: a 0-d bool device tensor (e.g. "the loss is finite" on every process); when False the
        queue is left exactly as it was, without a host read (see :meth:`NegativeQueue.push`).
        """
        if not self.has_queue:
            raise ValueError(f"enqueue needs a queue: this {type(self).__name__} has none "
                             f"(queue_size={getattr(self.config, 'queue_size', None)})")
        self.queue.enqueue(keys, instance_ids, step, check_finite, accept)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``; the loader materialises fresh parameters, so the key side is
        frozen again afterwards, and a queue's host-side pointer and fill count are read back from its
        buffers. A checkpoint without the queue's state is refused (it would start from an empty queue)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = [k for k in info.get("missing_keys", ()) if k.startswith("queue.")]
        if missing and model.has_queue:
            raise ValueError(
                f"The checkpoint lacks the queue state {sorted(missing)} (written before the queue kept instance ids, "
                "as loose 'queue', 'queue_ptr', 'queue_filled' tensors?). Load its state dict with "
                "model.load_state_dict(safetensors.torch.load_file(...)), which upgrades that layout, or retrain."
            )
        model.freeze_key_side()
        if model.has_queue:
            model.queue.sync_from_buffers()
        return (model, info) if want_info else model

    def negatives_per_anchor(self, per_device_batch_size: int | None, world_size: int = 1) -> int | None:
        """Negatives each anchor is contrasted with (a queue: once full); see :func:`hf_contrast.negatives_per_anchor`."""
        return negatives_per_anchor(self.config, per_device_batch_size, world_size)

    def check_training_setup(self, per_device_batch_size: int, world_size: int) -> None:
        """Raise a ``ValueError`` naming the field when training with this batch cannot work: no negatives, or
        a queue that each step's keys overwrite whole. Methods add their own checks."""
        if self.has_queue:
            keys = per_device_batch_size * world_size * self.queued_views
            if keys > self.config.queue_size:
                raise ValueError(
                    f"queue_size={self.config.queue_size} is smaller than the {keys} keys enqueued per micro-batch "
                    f"(per_device_train_batch_size={per_device_batch_size} x world size {world_size}"
                    + (f" x {self.queued_views} views" if self.queued_views > 1 else "") + f") of {self.describe()}: "
                    "each step would overwrite the whole queue. Use a larger queue_size or a smaller batch.")
        negatives = self.negatives_per_anchor(per_device_batch_size, world_size)
        if negatives is not None and negatives < 1:
            raise ValueError(
                f"per_device_train_batch_size={per_device_batch_size} x world size {world_size} gives "
                f"{self.describe()} no negatives ({negatives} per anchor): use a per-device batch of at least 2.")

    def describe(self) -> str:
        return self.method_name or type(self).__name__

    def explain_negatives(self, per_device_batch_size: int | None, world_size: int, negatives: int | None) -> str:
        """How the negatives of one anchor arise, in one paragraph of the model card (Markdown)."""
        return (f"Each anchor is contrasted with **{negatives} negatives** per step "
                f"({self.describe()}, per-device batch {per_device_batch_size}, {world_size} process(es)).")

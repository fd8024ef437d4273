"""hf_contrast: contrastive pretraining (MoCo v2, MoCo v3, SimCLR) of timm image encoders in the Hugging Face stack.

The public API is every name in ``__all__`` below, imported from here (``from hf_contrast import ...``):

- methods (:mod:`hf_contrast.models`): ``MoCoModel``/``MoCoConfig``, ``MoCoV3Model``/``MoCoV3Config``,
  ``SimCLRModel``/``SimCLRConfig``, the base ``ContrastivePreTrainedModel``/``ContrastiveConfig`` (the method
  interface a new method implements), ``ContrastiveOutput``, ``NegativeQueue``, the losses, ``momentum_at``,
  ``negatives_per_anchor``, ``false_negative_estimate``;
- data (:mod:`hf_contrast.data`): ``TwoViewAugmentation``, ``two_view_dataset``, ``TwoViewDataset``,
  ``StreamingTwoViewDataset``, ``DeviceAugmentation``, ``write_shards``, ``check_images``/``check_shards``,
  ``load_default_dataset``, ``load_idx_dataset`` (Fashion-MNIST's local files), the batched kernels as ``augment``;
- training (:mod:`hf_contrast.trainer`): ``ContrastiveTrainer``, ``ContrastiveTrainingArguments``,
  ``MomentumCallback``, ``NonFiniteLossError``, checkpoint helpers, ``grad_cache_step``, the monitors and
  diagnostics, ``ThroughputMeter``;
- sharing (:mod:`hf_contrast.hub`): ``export_encoder``, ``push_encoder_to_hub``, ``EncoderCardData``;
- evaluation (``knn_accuracy``, ``extract_features``, ``recalibrate_batch_norm``: Precise BN), ``peak_memory_bytes``, and ``distributed``.

Importing the package registers the three configurations and models with ``AutoConfig``/``AutoModel``, and
the Hub push of the encoder export as ``ContrastiveTrainer.push_to_hub``'s (the trainer does not import the Hub layer).
"""

from transformers import AutoConfig, AutoModel

from . import distributed
from .data import (
    TwoViewAugmentation,
    TwoViewDataset,
    augment,
    eval_dataset,
    find_image_column,
    load_default_dataset,
    load_idx_dataset,
    two_view_dataset,
)
from .data.device_augment import DeviceAugmentation
from .data.preflight import ShardError, UnreadableImageError, check_images, check_shards
from .data.shards import write_shards
from .data.streaming import StreamingError, StreamingTwoViewDataset, streaming_two_view_dataset
from .evaluation import extract_features, knn_accuracy, knn_top1, recalibrate_batch_norm
from .hub.export import export_encoder
from .hub.model_card import EncoderCardData
from .hub.push import HubPushError, push_encoder_to_hub
from .memory_probe import ActivationProbe, peak_memory_bytes, probe_activation_memory
from .models.backbone import ProjectionHead, create_backbone
from .models.base import ContrastiveOutput, ContrastivePreTrainedModel
from .models.configuration import ContrastiveConfig, MoCoConfig, MoCoV3Config, SimCLRConfig
from .models.corpus import false_negative_estimate
from .models.losses import (
    debiased_contrastive_loss,
    info_nce_logits,
    info_nce_loss,
    mocov3_logits,
    mocov3_loss,
    multi_positive_info_nce,
    nt_xent_logits,
    nt_xent_loss,
)
from .models.moco import MoCoModel
from .models.mocov3 import MoCoV3Model
from .models.momentum import ema_update_, momentum_at
from .models.negatives import negatives_per_anchor
from .models.queue import NegativeQueue
from .models.simclr import SimCLRModel
from .trainer import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MomentumCallback,
    NonFiniteLossError,
)
from .trainer.checkpointing import CheckpointError, check_checkpoint, last_complete_checkpoint
from .trainer.diagnostics import alignment, key_consistency, parameter_drift, uniformity
from .trainer.grad_cache import grad_cache_step
from .trainer.metrics import ContrastiveMetrics
from .trainer.monitors import KNNMonitor, RepresentationMonitor, TrainingMonitor
from .trainer.preemption import TrainingPreempted
from .trainer.queue_monitors import FalseNegativeMonitor, QueueConsistencyMonitor
from .trainer.throughput import ThroughputMeter, summarize_throughput

AutoConfig.register(MoCoConfig.model_type, MoCoConfig, exist_ok=True)
AutoConfig.register(SimCLRConfig.model_type, SimCLRConfig, exist_ok=True)
AutoConfig.register(MoCoV3Config.model_type, MoCoV3Config, exist_ok=True)
AutoModel.register(MoCoConfig, MoCoModel, exist_ok=True)
AutoModel.register(SimCLRConfig, SimCLRModel, exist_ok=True)
AutoModel.register(MoCoV3Config, MoCoV3Model, exist_ok=True)
ContrastiveTrainer.encoder_push = staticmethod(push_encoder_to_hub)  # trainer.push_to_hub(): the encoder export

__version__ = "0.1.0"

__all__ = [
    "augment",
    "distributed",
    "ActivationProbe",
    "CheckpointError",
    "TrainingPreempted",
    "ContrastiveConfig",
    "ContrastiveMetrics",
    "ContrastiveOutput",
    "ContrastivePreTrainedModel",
    "ContrastiveTrainer",
    "ContrastiveTrainingArguments",
    "DeviceAugmentation",
    "EncoderCardData",
    "HubPushError",
    "FalseNegativeMonitor",
    "KNNMonitor",
    "MoCoConfig",
    "MoCoModel",
    "MoCoV3Config",
    "MoCoV3Model",
    "NegativeQueue",
    "MomentumCallback",
    "NonFiniteLossError",
    "ProjectionHead",
    "QueueConsistencyMonitor",
    "RepresentationMonitor",
    "ShardError",
    "SimCLRConfig",
    "SimCLRModel",
    "StreamingError",
    "StreamingTwoViewDataset",
    "ThroughputMeter",
    "TrainingMonitor",
    "TwoViewAugmentation",
    "TwoViewDataset",
    "UnreadableImageError",
    "alignment",
    "check_checkpoint",
    "check_images",
    "check_shards",
    "create_backbone",
    "ema_update_",
    "eval_dataset",
    "export_encoder",
    "extract_features",
    "false_negative_estimate",
    "find_image_column",
    "grad_cache_step",
    "debiased_contrastive_loss",
    "info_nce_logits",
    "info_nce_loss",
    "key_consistency",
    "knn_accuracy",
    "knn_top1",
    "last_complete_checkpoint",
    "load_default_dataset",
    "load_idx_dataset",
    "momentum_at",
    "mocov3_logits",
    "mocov3_loss",
    "negatives_per_anchor",
    "nt_xent_logits",
    "multi_positive_info_nce",
    "nt_xent_loss",
    "parameter_drift",
    "peak_memory_bytes",
    "probe_activation_memory",
    "push_encoder_to_hub",
    "recalibrate_batch_norm",
    "streaming_two_view_dataset",
    "summarize_throughput",
    "two_view_dataset",
    "uniformity",
    "write_shards",
]

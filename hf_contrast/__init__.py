"""hf_contrast: contrastive pretraining (MoCo, SimCLR) of timm image encoders in the Hugging Face stack."""

from transformers import AutoConfig, AutoModel

from .backbone import ProjectionHead, create_backbone
from .configuration import ContrastiveConfig, MoCoConfig, SimCLRConfig
from .data import TwoViewAugmentation, eval_dataset, find_image_column, load_default_dataset, two_view_dataset
from .evaluation import extract_features, knn_accuracy, knn_top1
from .losses import info_nce_logits, info_nce_loss, nt_xent_logits, nt_xent_loss
from .metrics import ContrastiveMetrics
from .modeling_base import ContrastiveOutput, ContrastivePreTrainedModel
from .modeling_moco import MoCoModel
from .modeling_simclr import SimCLRModel
from .momentum import ema_update_, enqueue_, momentum_at
from .trainer import ContrastiveTrainer, ContrastiveTrainingArguments, MomentumCallback

AutoConfig.register(MoCoConfig.model_type, MoCoConfig, exist_ok=True)
AutoConfig.register(SimCLRConfig.model_type, SimCLRConfig, exist_ok=True)
AutoModel.register(MoCoConfig, MoCoModel, exist_ok=True)
AutoModel.register(SimCLRConfig, SimCLRModel, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "ContrastiveConfig",
    "ContrastiveMetrics",
    "ContrastiveOutput",
    "ContrastivePreTrainedModel",
    "ContrastiveTrainer",
    "ContrastiveTrainingArguments",
    "MoCoConfig",
    "MoCoModel",
    "MomentumCallback",
    "ProjectionHead",
    "SimCLRConfig",
    "SimCLRModel",
    "TwoViewAugmentation",
    "create_backbone",
    "ema_update_",
    "enqueue_",
    "eval_dataset",
    "extract_features",
    "find_image_column",
    "info_nce_logits",
    "info_nce_loss",
    "knn_accuracy",
    "knn_top1",
    "load_default_dataset",
    "momentum_at",
    "nt_xent_logits",
    "nt_xent_loss",
    "two_view_dataset",
]

"""Training: :class:`ContrastiveTrainer` (transformers' Trainer with the queue, the EMA and contrastive logs), its
arguments and callbacks, checkpoint completeness, the loss guard, gradient caching, LARS, throughput, metrics
and the training monitors."""

from .arguments import ContrastiveTrainingArguments
from .callbacks import EpochCallback, MomentumCallback, StreamEpochCallback
from .contrastive_trainer import ContrastiveTrainer
from .loss_guard import NonFiniteLossError

__all__ = ["ContrastiveTrainer", "ContrastiveTrainingArguments", "EpochCallback", "MomentumCallback",
           "NonFiniteLossError", "StreamEpochCallback"]

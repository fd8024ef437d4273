"""The methods: configurations (:mod:`.configuration`), the method interface every model implements
(:mod:`.base`), MoCo v2 (:mod:`.moco`), MoCo v3 (:mod:`.mocov3`) and SimCLR (:mod:`.simclr`), and what they are
built from: the timm backbone and heads (:mod:`.backbone`), split-BN, the negative queue, the EMA, the losses,
the negative counts, false-negative handling and the corpus estimate."""

from .base import ContrastiveOutput, ContrastivePreTrainedModel
from .configuration import ContrastiveConfig, MoCoConfig, MoCoV3Config, SimCLRConfig
from .moco import MoCoModel
from .mocov3 import MoCoV3Model
from .queue import NegativeQueue
from .simclr import SimCLRModel

__all__ = ["ContrastiveConfig", "ContrastiveOutput", "ContrastivePreTrainedModel", "MoCoConfig", "MoCoModel",
           "MoCoV3Config", "MoCoV3Model", "NegativeQueue", "SimCLRConfig", "SimCLRModel"]

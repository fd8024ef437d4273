"""Sharing the encoder: the timm-format export (:mod:`.export`), the model card's data, text and curves
(:mod:`.model_card`) and the push to the Hub (:mod:`.push`)."""

from .export import export_encoder
from .model_card import EncoderCardData
from .push import HubPushError, push_encoder_to_hub

__all__ = ["EncoderCardData", "HubPushError", "export_encoder", "push_encoder_to_hub"]

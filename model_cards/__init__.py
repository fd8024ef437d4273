"""Package data: the Jinja model card template (installed as ``hf_contrast.model_cards``)."""

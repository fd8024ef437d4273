"""``StopAt``: a callback that ends training after a given optimizer step, as a crash or a pre-empted job
would (the resume tests restart from what that step saved). Shared by the tests and the torchrun scripts."""

from transformers import TrainerCallback


class StopAt(TrainerCallback):
    """Set ``should_training_stop`` at the end of optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True

"""What the scripts in ``training/`` share on the command line: a parser that takes no abbreviated
flags, log lines with numbers (not quoted strings), loader defaults that fit the machine, and the
checks a run makes before it spends any compute (a used output folder, a run of zero steps)."""

from __future__ import annotations

import math
import os
import re
import sys

import torch
from transformers import HfArgumentParser
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging

from .trainer.checkpointing import previous_run
from .trainer.preemption import TrainingPreempted

logger = logging.get_logger("hf_contrast.trainer")


def make_parser(dataclass_types) -> HfArgumentParser:
    """``HfArgumentParser`` without argparse's prefix matching: ``--learning_rat 0.1`` is an error naming
    the flag, not a silent ``--learning_rate``."""
    return HfArgumentParser(dataclass_types, allow_abbrev=False)


def set_help(parser: HfArgumentParser, flag: str, text: str) -> None:
    """Replace the ``--help`` text of ``flag`` (a field of a dataclass the script does not own)."""
    parser._option_string_actions[flag].help = text


def fit_loader_to_device(training_args) -> None:
    """Pinned memory and non-blocking copies only when batches go to a CUDA device: on the CPU, pinning warns
    ("pin_memory ... no accelerator is found") and non-blocking copies have nothing to overlap."""
    cuda = torch.cuda.is_available() and not training_args.use_cpu
    if not cuda:
        training_args.dataloader_pin_memory = False
        config = getattr(training_args, "accelerator_config", None)
        if config is not None and getattr(config, "non_blocking", False):
            config.non_blocking = False  # transformers warns "non_blocking is enabled but dataloader_pin_memory is not"


def _number(value):
    """Floats to 4 significant digits, kept numbers (transformers' bar prints them as quoted strings)."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


def numeric_logs(logs: dict) -> dict:
    """A log with floats rounded to 4 significant digits and kept numbers: transformers 5's progress bar and
    printer print them as quoted strings (``{'loss': '2.382'}``)."""
    return {k: _number(v) for k, v in logs.items() if k != "total_flos"}


class NumericProgressCallback(ProgressCallback):
    """transformers' progress bar, writing each log as ``{'loss': 2.382, 'epoch': 0.5}`` (a Python literal)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.write(str(numeric_logs(logs)))


class NumericPrinterCallback(PrinterCallback):
    """transformers' printer (``disable_tqdm``), printing numbers as numbers."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs is not None:
            print(numeric_logs(logs))


def use_numeric_progress(trainer) -> None:
    """Swap the trainer's progress bar or printer for the numeric ones above."""
    for stock, numeric in ((ProgressCallback, NumericProgressCallback), (PrinterCallback, NumericPrinterCallback)):
        if trainer.pop_callback(stock) is not None:
            trainer.add_callback(numeric)


def check_output_dir(output_dir: str, resume: bool, overwrite: bool, script: str = "training/pretrain.py") -> None:
    """Refuse to start in an ``output_dir`` holding a previous run (checkpoints, ``final``, ``encoder``) unless the
    run resumes it or ``--overwrite_output_dir`` says to replace it. Touches nothing on disk.

    Raises:
        FileExistsError: naming what is there and both ways on.
    """
    found = previous_run(output_dir)
    if found and not resume and not overwrite:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise FileExistsError(
            f"--output_dir {output_dir} holds a previous run ({shown}). Nothing was changed. To continue that run: "
            f"{script} ... --resume_from_checkpoint last; to replace it: add --overwrite_output_dir; or pass a new "
            "--output_dir."
        )


def planned_steps(num_images: int, per_device_batch: int, world_size: int, accumulation: int, drop_last: bool,
                  num_train_epochs: float, max_steps: int) -> tuple[int, int]:
    """``(batches per process per epoch, optimizer steps of the run)`` as transformers' Trainer takes them: each
    process gets ``num_images / world_size`` images, in batches of ``per_device_batch`` (a short last batch is
    dropped with ``drop_last``), and an epoch ends with an optimizer step after its last, possibly short,
    accumulation window."""
    per_process = num_images // world_size if drop_last else math.ceil(num_images / world_size)
    batches = per_process // per_device_batch if drop_last else math.ceil(per_process / per_device_batch)
    if batches == 0:
        return 0, 0
    if max_steps > 0:
        return batches, max_steps
    return batches, math.ceil(num_train_epochs * math.ceil(batches / accumulation))


def check_planned_steps(num_images: int, training_args, what: str = "training images") -> int:
    """Refuse a run of 0 optimizer steps before anything runs; warn about a run shorter than one logging window
    (the trainer's :class:`~hf_contrast.trainer.callbacks.LastStepLogCallback` logs its last step).

    Returns:
        The optimizer steps the run will take.

    Raises:
        ValueError: naming the dataset size, the batch, ``drop_last``, the world size, the accumulation and the fix.
    """
    a = training_args
    batch, world, accumulation = a.per_device_train_batch_size, a.world_size, a.gradient_accumulation_steps
    batches, steps = planned_steps(num_images, batch, world, accumulation, a.dataloader_drop_last,
                                   a.num_train_epochs, a.max_steps)
    setup = (f"{num_images} {what}, --per_device_train_batch_size {batch} x world size {world} (with "
             f"--dataloader_drop_last {a.dataloader_drop_last}), --gradient_accumulation_steps {accumulation}")
    if batches == 0:
        raise ValueError(
            f"This run would take 0 optimizer steps: {setup} give each process no "
            f"{'complete ' if a.dataloader_drop_last else ''}batch. Use a batch of at most {num_images // world} "
            f"(--per_device_train_batch_size {max(num_images // world, 1)}), or more images."
        )
    window = a.logging_steps if a.logging_steps >= 1 else 1  # a fraction < 1 is a share of the run
    if a.logging_strategy == "steps" and steps < window:  # a smoke test: the trainer logs its last step instead
        logger.warning(
            f"This run takes {steps} optimizer step(s), fewer than one logging window (--logging_steps {window:g}): "
            f"{setup}. The loss is logged once, at the last step (pass --logging_steps {max(steps, 1)} to log sooner)."
        )
    return steps


def flag_names(message: str, flags: set[str]) -> str:
    """``message`` with each ``field=value`` of a known flag written as the command line spells it:
    ``queue_size=0 is invalid`` -> ``--queue_size 0 is invalid`` (``backbone='resnet_18'`` -> ``--backbone resnet_18``)."""
    def spell(match: re.Match) -> str:
        name, value = match.group(1), match.group(2).strip("'\"")
        return f"--{name} {value}" if name in flags else match.group(0)

    return re.sub(r"(?<![\w-])([A-Za-z_]\w*)=('[^']*'|\"[^\"]*\"|[^\s,;)]+?)(?=[\s,;)]|[.:](?:\s|$)|$)", spell, message)


def _while_training(traceback) -> bool:
    """Whether the error came out of transformers' training loop (a failure to debug, not a setup mistake)."""
    while traceback is not None:
        if traceback.tb_frame.f_code.co_name == "_inner_training_loop":
            return True
        traceback = traceback.tb_next
    return False


def run_main(main, parser, argv: list[str] | None = None):
    """Run a script's ``main(argv)`` as a command: a mistake found before training (a ``ValueError``,
    ``FileNotFoundError``, ``FileExistsError`` or ``CheckpointError`` raised before transformers' training
    loop) prints ``PROG: error: MESSAGE`` with the flag names of ``parser`` and exits 2, as argparse does for
    an unknown flag; library callers of ``main`` keep the exception. Errors during training, and every error
    with ``HF_CONTRAST_TRACEBACK=1``, keep their traceback. A run stopped by SIGTERM (its checkpoint written,
    :class:`~hf_contrast.trainer.preemption.TrainingPreempted`) prints how to resume and exits 143."""
    try:
        return main(argv)
    except TrainingPreempted as error:  # SIGTERM: a complete checkpoint is on disk; 143 = 128 + SIGTERM
        if os.environ.get("RANK", "0") == "0":  # once under torchrun, where every process stops at the same step
            print(f"{parser.prog}: {error}", file=sys.stderr)
        raise SystemExit(143) from None
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        if _while_training(error.__traceback__) or os.environ.get("HF_CONTRAST_TRACEBACK", "") not in ("", "0"):
            raise
        flags = {action.dest for action in parser._actions}
        message = flag_names(str(error), flags)
        print(f"{parser.prog}: error: {message}\n(HF_CONTRAST_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None

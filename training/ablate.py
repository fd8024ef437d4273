#!/usr/bin/env python
"""MoCo's momentum and queue-size ablations on the embedded MNIST digits, measured with the monitors.

Each run pretrains MoCo (timm resnet18 at 32 px, BatchNorm head with output BatchNorm) on the 4,000
training digits with the training monitors on: kNN top-1 on the 1,000 held-out digits, queue
consistency by key age and key-encoder drift, alignment and uniformity. The script writes, under
``--output_dir``: ``README.md`` (the tables and the command), ``momentum.png``, ``queue_size.png``
and ``runs/<name>.json`` (each run's summary and full log history). A run whose JSON exists with
the same settings is reused, so an interrupted sweep resumes.

    python training/ablate.py                                  # the default sweep: 7 runs, ~25 min
    python training/ablate.py --momenta 0 0.99 --queue_sizes 2048 --num_train_epochs 1   # a quick look
    # the false-negative sweep of results/false_negatives: 4 queue sizes x 4 variants x 2 seeds, ~2.5 h
    python training/ablate.py --momenta 0.99 --queue_sizes 256 1024 2048 4096 --seeds 0 1 \
        --false_negative_variants none exclude eliminate attract --output_dir results/false_negatives

Every field of :class:`AblationArguments` is a command-line flag (``--help`` lists them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import transformers
from ablate_report import write_report
from false_negative_report import write_report as write_false_negative_report
from transformers import set_seed

import hf_contrast
from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    FalseNegativeMonitor,
    KNNMonitor,
    MoCoConfig,
    MoCoModel,
    QueueConsistencyMonitor,
    RepresentationMonitor,
    TwoViewAugmentation,
    eval_dataset,
    knn_accuracy,
    two_view_dataset,
)
from hf_contrast.cli import make_parser, run_main
from hf_contrast.data import DIGITS_MEAN, DIGITS_STD

logger = logging.getLogger("ablate")


# --false_negative_variants: name -> (exclude_same_instance, false_negatives)
FALSE_NEGATIVE_VARIANTS = {"none": (False, None), "exclude": (True, None), "eliminate": (True, "eliminate"),
                           "attract": (True, "attract")}


@dataclass
class AblationArguments:
    """The sweep: momenta at ``base_queue_size``, then queue sizes at ``base_momentum``; the rest is
    the recipe every run shares."""

    momenta: list[float] = field(default_factory=lambda: [0.0, 0.9, 0.99, 0.999],
                                 metadata={"help": "EMA momenta swept at base_queue_size."})
    queue_sizes: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096],
                                   metadata={"help": "Queue sizes swept at base_momentum."})
    base_momentum: float = field(default=0.99, metadata={"help": "Momentum of the queue-size sweep."})
    base_queue_size: int = field(default=2048, metadata={"help": "Queue size of the momentum sweep."})
    num_train_epochs: float = field(default=5, metadata={"help": "Epochs per run (31 steps at batch 128)."})
    batch_size: int = field(default=128, metadata={"help": "Images per step."})
    backbone: str = field(default="resnet18", metadata={"help": "timm architecture."})
    learning_rate: float = field(default=0.06, metadata={"help": "SGD learning rate (momentum 0.9, cosine)."})
    temperature: float = field(default=0.2, metadata={"help": "InfoNCE temperature."})
    consistency_every: int = field(default=10, metadata={"help": "Steps between consistency measurements."})
    knn_evaluations: int = field(default=2, metadata={"help": "kNN / representation evaluations per run."})
    seed: int = field(default=0, metadata={"help": "Seed of every run."})
    threads: int = field(default=1, metadata={"help": "torch threads (1 is fastest on loaded cores)."})
    output_dir: str = field(default="results/ablation", metadata={"help": "Where the results go."})
    exclude_same_instance: bool = field(default=False, metadata={
        "help": "Mask queued keys of the anchor's own image (off: as the committed sweep ran, before ids existed)."})
    false_negatives: str | None = field(default=None, metadata={
        "help": "False-negative cancellation: eliminate or attract (default: off)."})
    false_negative_top_k: int = field(default=10, metadata={"help": "Candidates cancellation takes per anchor."})
    seeds: list[int] | None = field(default=None, metadata={
        "help": "Run the whole plan once per seed (instead of --seed); run names of seeds other than 0 end in _seedN."})
    false_negative_variants: list[str] | None = field(default=None, metadata={
        "help": f"Run the plan once per variant, one of {FALSE_NEGATIVE_VARIANTS} each (eliminate and attract with "
                "same-instance exclusion, top --false_negative_top_k); writes the false-negative report."})
    false_negative_report: bool = field(default=False, metadata={
        "help": "Write the false-negative report (always on with a false-negative option; turn it on for the "
                "no-masking runs of that sweep)."})


def expand(a: AblationArguments) -> list[AblationArguments]:
    """One set of arguments per (seed, false-negative variant) that ``--seeds`` and
    ``--false_negative_variants`` ask for (just ``a`` when neither is given)."""
    variants = a.false_negative_variants or []
    bad = [v for v in variants if v not in FALSE_NEGATIVE_VARIANTS]
    if bad:
        raise ValueError(f"false_negative_variants={bad!r} is invalid: each must be one of "
                         f"{list(FALSE_NEGATIVE_VARIANTS)}")
    out = []
    for seed in a.seeds or [a.seed]:
        for v in variants or [None]:
            kw = {"seed": seed}
            if v is not None:
                exclude, fn = FALSE_NEGATIVE_VARIANTS[v]
                kw.update(exclude_same_instance=exclude, false_negatives=fn, false_negative_report=True)
            out.append(dataclasses.replace(a, **kw))
    return out


def run_name(momentum: float, queue_size: int, a: AblationArguments | None = None) -> str:
    suffix = "" if a is None else "".join(f"_{k}" for k in false_negative_settings(a).values() if isinstance(k, str))
    if a is not None and a.seed != 0:  # seeds share one runs/ directory (seed 0 keeps the committed names)
        suffix += f"_seed{a.seed}"
    return f"m{momentum:g}_q{queue_size}{suffix}"


def false_negative_settings(a: AblationArguments) -> dict:
    """The false-negative options that differ from the committed sweep (none: its JSON files are reused)."""
    out = {}
    if a.exclude_same_instance:
        out["exclude_same_instance"] = "exclude"
    if a.false_negatives:
        out.update(false_negatives=a.false_negatives, false_negative_top_k=a.false_negative_top_k)
    return out


def build_model(a: AblationArguments, momentum: float, queue_size: int) -> MoCoModel:
    return MoCoModel(MoCoConfig(
        backbone=a.backbone, projection_hidden_dim=512, projection_dim=128, projection_layers=2,
        projection_batch_norm=True, projection_output_batch_norm=True,  # without them MoCo collapses here
        temperature=a.temperature, image_size=32, queue_size=queue_size, momentum=momentum,
        momentum_schedule="constant", symmetric_loss=False, shuffle_bn=True, key_bn_splits=1,
        exclude_same_instance=a.exclude_same_instance, false_negatives=a.false_negatives,
        false_negative_top_k=a.false_negative_top_k,
    ))


def settings(a: AblationArguments, momentum: float, queue_size: int) -> dict:
    keys = ("num_train_epochs", "batch_size", "backbone", "learning_rate", "temperature", "consistency_every",
            "knn_evaluations", "seed")
    return {"momentum": momentum, "queue_size": queue_size, **{k: getattr(a, k) for k in keys},
            **false_negative_settings(a)}


def run_one(a: AblationArguments, momentum: float, queue_size: int, data: dict) -> dict:
    """Pretrain one configuration with the monitors on; return its summary and log history."""
    set_seed(a.seed)
    model = build_model(a, momentum, queue_size)
    steps_per_epoch = len(data["train"]) // a.batch_size
    max_steps = math.ceil(a.num_train_epochs * steps_per_epoch)
    with tempfile.TemporaryDirectory() as tmp:
        args = ContrastiveTrainingArguments(
            output_dir=tmp, num_train_epochs=a.num_train_epochs, per_device_train_batch_size=a.batch_size,
            learning_rate=a.learning_rate, optim="sgd", optim_args="momentum=0.9", weight_decay=5e-4,
            lr_scheduler_type="cosine", warmup_steps=0.05, logging_steps=10, save_strategy="no", report_to=[],
            seed=a.seed, dataloader_num_workers=0, disable_tqdm=True, use_cpu=True,
        )
        trainer = ContrastiveTrainer(model=model, args=args, train_dataset=data["two_view_train"])
        every = math.ceil(max_steps / a.knn_evaluations)
        knn = KNNMonitor(data["bank"], data["held_out"], every, cache_inputs=True).attach(trainer)
        health = RepresentationMonitor(data["two_view_test"], every, num_samples=512).attach(trainer)
        queue = QueueConsistencyMonitor(every_n_steps=a.consistency_every).attach(trainer)
        fn_monitor = FalseNegativeMonitor(data["train"]["label"], data["held_out"], every).attach(trainer)
        start = time.perf_counter()
        trainer.train()
        runtime = time.perf_counter() - start
    history = trainer.state.log_history
    train_logs = [h for h in history if "loss" in h]
    full = [h for h in queue.history if all(f"queue_consistency_age{age}" in h for age in queue.ages)]
    mean = lambda key, rows: sum(r[key] for r in rows) / len(rows) if rows else float("nan")  # noqa: E731
    steps = trainer.state.global_step
    monitor_seconds = knn.seconds + health.seconds + queue.seconds + fn_monitor.seconds
    step_seconds = (runtime - monitor_seconds) / steps
    return {
        "name": run_name(momentum, queue_size, a),
        "false_negatives": fn_monitor.history[-1] if fn_monitor.history else None,
        "num_negatives": train_logs[-1].get("num_negatives") if train_logs else None,
        "settings": settings(a, momentum, queue_size),
        "steps": steps,
        "ages": queue.ages,
        "knn_top1": knn.history[-1]["knn_top1"],
        "queue_consistency": mean("queue_consistency", full),  # over training, once every age is in the queue
        "consistency_by_age": {str(age): mean(f"queue_consistency_age{age}", full) for age in queue.ages},
        "key_drift": mean("key_drift", queue.history),
        "alignment": health.history[-1]["alignment"],
        "uniformity": health.history[-1]["uniformity"],
        "heldout_embedding_std": health.history[-1]["heldout_embedding_std"],
        "final_loss": train_logs[-1]["loss"] if train_logs else float("nan"),
        "no_signal_loss": math.log(queue_size + 1),
        "runtime_s": runtime,
        "step_s": step_seconds,
        "queue_monitor_s": queue.seconds,
        "queue_monitor_measurements": len(queue.history),
        "queue_monitor_fraction": queue.seconds / (runtime - monitor_seconds),
        "knn_monitor_s": knn.seconds,
        "health_monitor_s": health.seconds,
        "log_history": history,
    }


def load_data(a: AblationArguments) -> dict:
    splits = hf_contrast.load_default_dataset()
    aug = TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0), flip_p=0.0,  # as training/pretrain.py
                                           mean=DIGITS_MEAN, std=DIGITS_STD)
    return {
        "train": splits["train"],
        "two_view_train": two_view_dataset(splits["train"], aug),
        "two_view_test": two_view_dataset(splits["test"], aug),
        "bank": eval_dataset(splits["train"], aug),
        "held_out": eval_dataset(splits["test"], aug),
    }


def baselines(a: AblationArguments, data: dict, path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    start = time.perf_counter()
    set_seed(a.seed)
    random_init = build_model(a, 0.99, 256).encoder
    out = {"raw_pixels": knn_accuracy(None, data["bank"], data["held_out"]),
           "random_init": knn_accuracy(random_init, data["bank"], data["held_out"])}
    out["seconds"] = time.perf_counter() - start
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    (a,) = make_parser(AblationArguments).parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    runs_dir = os.path.join(a.output_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    cli = sys.argv[1:] if argv is None else argv
    command = " ".join(["python training/ablate.py", *(shlex.quote(x) for x in cli)])
    plan = [(m, a.base_queue_size) for m in a.momenta] + [(a.base_momentum, q) for q in a.queue_sizes]
    plan = list(dict.fromkeys(plan))  # the base run belongs to both sweeps: run it once
    plan = [(c, m, q) for c in expand(a) for m, q in plan]  # (arguments, momentum, queue size)
    data = load_data(a)
    base = baselines(a, data, os.path.join(runs_dir, "baselines.json"))
    logger.info(f"kNN top-1: raw pixels {base['raw_pixels']:.4f}, random init {base['random_init']:.4f}")
    results = []
    for i, (c, momentum, queue_size) in enumerate(plan):
        path = os.path.join(runs_dir, run_name(momentum, queue_size, c) + ".json")
        if os.path.exists(path):
            with open(path) as f:
                previous = json.load(f)
            if previous["settings"] == settings(c, momentum, queue_size):
                logger.info(f"[{i + 1}/{len(plan)}] {previous['name']}: reusing {path}")
                results.append(previous)
                continue
        logger.info(f"[{i + 1}/{len(plan)}] {run_name(momentum, queue_size, c)}: training")
        r = run_one(c, momentum, queue_size, data)
        logger.info(f"  kNN {r['knn_top1']:.4f}, consistency {r['queue_consistency']:.4f}, "
                    f"drift {r['key_drift']:.4f}, {r['runtime_s']:.0f} s ({r['step_s']:.2f} s/step), "
                    "queue monitor "
                    f"{100 * r['queue_monitor_fraction']:.1f}% of training time")
        with open(path, "w") as f:
            json.dump(r, f, indent=1)
        results.append(r)
    a = plan[-1][0]  # the report's kind follows the variants
    if false_negative_settings(a) or a.false_negative_report:
        write_false_negative_report(a.output_dir, command)  # training/false_negative_report.py
    else:  # README.md, momentum.png, queue_size.png: training/ablate_report.py
        by_name = {r["name"]: r for r in results}
        mom = [by_name[run_name(m, a.base_queue_size)] for m in a.momenta]
        que = [by_name[run_name(a.base_momentum, q)] for q in a.queue_sizes]
        write_report(a, mom, que, results, base, command, len(data["train"]))
    return results


if __name__ == "__main__":
    run_main(main, make_parser(AblationArguments))

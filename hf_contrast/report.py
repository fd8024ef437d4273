"""The end of a pretraining run, as ``training/pretrain.py`` prints and ships it: the table of kNN top-1 (the
pretrained encoder, a random init, raw pixels), the losses and the throughput; the encoder export with its
model card, and its push to the Hub."""

from __future__ import annotations

import os

from .hub.export import export_encoder
from .hub.push import push_encoder_to_hub
from .models.mocov3 import MoCoV3Model
from .models.simclr import SimCLRModel


def print_report(results: dict[str, float], final_dir: str, model) -> None:
    """Print the table of the rows ``results`` holds (kNN top-1 of the pretrained encoder, a random init and raw
    pixels; the final and no-signal losses; the throughput) and where the checkpoint ``final_dir`` is."""
    rows = [
        ("kNN top-1, pretrained encoder", results.get("knn_pretrained")),
        ("kNN top-1, same architecture at random init (BN recalibrated)", results.get("knn_random_init")),
        ("kNN top-1, raw pixels", results.get("knn_raw_pixels")),
        ("final training loss", results.get("final_loss")),
        (no_signal_label(model), results.get("no_signal_loss")),
    ]
    throughput = [
        ("training images/s, all processes (windows after the first)", results.get("images_per_second"), "{:>8.1f}"),
        ("share of training time waiting for data", results.get("data_wait_fraction"), "{:>8.1%}"),
    ]
    rows = [(label, value, "{:>8.4f}") for label, value in rows] + throughput
    width = max(len(r[0]) for r in rows)
    print("\n" + "=" * (width + 12))
    for label, value, style in rows:
        if value is not None:
            print(f"{label:<{width}}  {style.format(value)}")
    print("=" * (width + 12))
    print(f"Checkpoint ({type(model).__name__}, loads with AutoModel.from_pretrained after `import hf_contrast`):")
    print(f"  {os.path.abspath(final_dir)}")


def no_signal_label(model) -> str:
    """What the no-signal loss of ``model``'s method is: uniform scores over the positive and its negatives."""
    if isinstance(model, SimCLRModel):
        return "ln(2N-1): the SimCLR loss of a model with no signal"
    if isinstance(model, MoCoV3Model):
        extra = " + K" if model.has_queue else ""
        return f"4T x ln(N*W{extra}): the MoCo v3 loss of a model with no signal"
    return "ln(K+1): the MoCo loss of a model with no signal"


def export_and_push(trainer, export_dir, augmentation, results, data_args, name, test, num_images,
                    push_args=None) -> None:
    """Export the encoder (timm format + model card) to ``export_dir``; push it when ``push_args`` is given."""
    baselines = {label: results[key] for key, label in (("knn_random_init", "same architecture at random init"),
                                                        ("knn_raw_pixels", "raw pixels")) if key in results}
    export_encoder(
        trainer, export_dir, augmentation=augmentation, knn_top1=results.get("knn_pretrained"), knn_baselines=baselines,
        knn_details=knn_details(data_args, test, results) if "knn_pretrained" in results else None,
        datasets=[data_args.dataset_name] if data_args.dataset_name not in (None, "webdataset") else [],
        dataset_description=name, num_train_images=num_images,
        repo_id=push_args.hub_model_id if push_args is not None else None,
        overwrite=True,  # OUTPUT_DIR/encoder belongs to this script, like OUTPUT_DIR/final: a rerun replaces it
    )
    print(f"Encoder export (timm format, loads without hf_contrast): {os.path.abspath(export_dir)}")
    if push_args is not None:
        info = push_encoder_to_hub(export_dir, push_args.hub_model_id, token=push_args.hub_token,
                                   private=push_args.hub_private_repo)
        print(f"Pushed to {info.commit_url}")


def knn_details(data_args, test, results: dict) -> str:
    """How the card's kNN top-1 was measured."""
    details = f"k={data_args.knn_k}, t=0.1, on {len(test)} held-out images"
    if results.get("precise_bn_images"):
        details += f"; BatchNorm statistics re-estimated on {results['precise_bn_images']} un-augmented training images"
    return details

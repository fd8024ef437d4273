"""kNN top-1 (k=200, t=0.1) of exported encoders as saved, then after Precise BN (BatchNorm statistics
re-estimated on the 4,000 un-augmented training digits, as pretrain.py now does before it saves).

    python results/bisect/precise_bn_eval.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR holds the ``encoder/`` export of a pretrain.py run with the default resnet18. Run it on
exports made with ``--precise_bn_batches 0`` (or by code older than Precise BN)."""

import sys

import timm
from safetensors.torch import load_file

import hf_contrast
from hf_contrast.data import DIGITS_MEAN, DIGITS_STD, TwoViewAugmentation, eval_dataset
from hf_contrast.evaluation import knn_accuracy, recalibrate_batch_norm


def main(run_dirs: list[str]) -> None:
    splits = hf_contrast.load_default_dataset()
    aug = TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0), flip_p=0.0, mean=DIGITS_MEAN, std=DIGITS_STD)
    train, test = (eval_dataset(splits[s], aug) for s in ("train", "test"))
    for run_dir in run_dirs:
        encoder = timm.create_model("resnet18", pretrained=False, num_classes=0)
        encoder.load_state_dict(load_file(f"{run_dir}/encoder/model.safetensors"))
        saved = knn_accuracy(encoder.eval(), train, test, k=200)
        recalibrate_batch_norm(encoder, train, max_batches=16)
        print(f"{run_dir}: kNN {saved:.3f} as saved, {knn_accuracy(encoder.eval(), train, test, k=200):.3f} after Precise BN")


if __name__ == "__main__":
    main(sys.argv[1:])

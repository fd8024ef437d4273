#!/usr/bin/env python
"""Write an image dataset as webdataset tar shards of JPEGs (plus ``sizes.json``) for streaming.

    python training/write_shards.py --output_dir shards                      # the embedded digits
    python training/write_shards.py --train_dir path/to/images --output_dir shards
    python training/write_shards.py --dataset_name cifar10 --output_dir shards --images_per_shard 1000

Then ``python training/pretrain.py --dataset_name webdataset --data_files "shards/*.tar" --streaming
--max_steps N``. A stream is split by shard: write at least world size x dataloader workers shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets

import hf_contrast
from hf_contrast.cli import make_parser, run_main


@dataclass
class ShardArguments:
    output_dir: str = field(metadata={"help": "Where the shard-NNNNNN.tar files and sizes.json go."})
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset; default: the embedded digits."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    split: str = field(default="train", metadata={"help": "The split to write."})
    train_dir: str | None = field(default=None, metadata={"help": "A local image folder (imagefolder layout)."})
    image_column: str | None = field(default=None, metadata={"help": "Image column; found automatically."})
    label_column: str = field(default="label", metadata={"help": "Written as KEY.cls when present."})
    images_per_shard: int = field(default=1000, metadata={"help": "Samples per tar."})


def main(argv: list[str] | None = None) -> list[str]:
    (args,) = make_parser(ShardArguments).parse_args_into_dataclasses(args=argv)  # no abbreviated flags
    if args.train_dir is not None:
        dataset = args.train_dir
    elif args.dataset_name is None:
        dataset = hf_contrast.load_default_dataset()[args.split]
    else:
        dataset = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split=args.split)
    paths = hf_contrast.write_shards(dataset, args.output_dir, args.images_per_shard, args.image_column,
                                     args.label_column)
    print(f"Wrote {len(paths)} shards to {args.output_dir}")
    return paths


if __name__ == "__main__":
    run_main(main, make_parser(ShardArguments))

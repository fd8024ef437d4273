"""training/pretrain.py on webdataset shards written from the digits, streamed, with the kNN report."""

import json

from safetensors.torch import load_file

from hf_contrast import write_shards


def test_pretrain_streams_webdataset_shards(pretrain, digits, tmp_path, capsys):
    write_shards(digits["train"].select(range(384)), str(tmp_path / "shards"), images_per_shard=96)
    results = pretrain.main([
        "--dataset_name", "webdataset", "--data_files", str(tmp_path / "shards" / "*.tar"), "--streaming", "True",
        "--max_steps", "6", "--backbone", "test_resnet", "--projection_hidden_dim", "32",
        "--per_device_train_batch_size", "32", "--queue_size", "128", "--knn_samples", "200", "--knn_k", "20",
        "--output_dir", str(tmp_path / "out"), "--save_strategy", "no", "--disable_tqdm", "True",
        "--dataloader_num_workers", "2", "--logging_steps", "3", "--device_augmentation", "True",
    ])
    out = capsys.readouterr().out
    assert "kNN top-1, pretrained encoder" in out and "raw pixels" in out  # the shards carry labels (cls)
    for key in ("knn_pretrained", "knn_random_init", "knn_raw_pixels"):  # accuracies on the 40 held-out samples
        assert abs(results[key] * 40 - round(results[key] * 40)) < 1e-6, key  # (200 labelled, test_split_size 0.2)
    assert results["images_per_second"] > 0 and 0 <= results["data_wait_fraction"] <= 1
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == results
    # 6 steps of 32 streamed images, their views made on the device, each step's 32 keys enqueued in order into
    # the 128-slot queue: slots 0-63 were overwritten by steps 4 and 5, 64-127 hold steps 2 and 3
    final = load_file(tmp_path / "out" / "final" / "model.safetensors")
    assert int(final["queue.filled"]) == 128 and int(final["queue.ptr"]) == 6 * 32 % 128
    assert final["queue.entry_steps"].tolist() == [4] * 32 + [5] * 32 + [2] * 32 + [3] * 32
    assert (final["queue.instance_ids"] == -1).all()  # streamed samples carry no instance id (README): never masked
    assert "| optimizer steps | 6 |" in (tmp_path / "out" / "encoder" / "README.md").read_text()

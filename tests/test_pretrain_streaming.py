"""training/pretrain.py on webdataset shards written from the digits, streamed, with the kNN report."""

import json

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
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()
    assert (tmp_path / "out" / "encoder" / "README.md").exists()

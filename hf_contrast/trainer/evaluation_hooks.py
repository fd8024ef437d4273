"""The trainer's evaluation hooks: every held-out image evaluated (no dropped last batch), read-only prediction
steps (queue, EMA, BatchNorm statistics and training metrics untouched), contrastive metrics of the evaluated
pairs, and the training run's random stream left as it was."""

from __future__ import annotations

import torch

from .metrics import ContrastiveMetrics


class EvaluationHooks:
    """Mixed into :class:`~hf_contrast.ContrastiveTrainer` (before ``transformers.Trainer``)."""

    def get_eval_dataloader(self, eval_dataset=None):
        """Trainer's, but keeping the last short batch: ``dataloader_drop_last`` (on by default, for a constant
        number of negatives in training) must not leave images out of an evaluation."""
        return self._keeping_last_batch(super().get_eval_dataloader, eval_dataset)

    def get_test_dataloader(self, test_dataset):
        """Trainer's, keeping the last short batch: :meth:`predict` returns one row per image."""
        return self._keeping_last_batch(super().get_test_dataloader, test_dataset)

    def _keeping_last_batch(self, make, dataset):
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            return make(dataset)
        finally:
            self.args.dataloader_drop_last = drop_last

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """One evaluation / prediction batch, read-only: the queue, the key encoder's EMA, BatchNorm
        statistics and the training metrics are left as they were.

        Returns ``(loss, embeddings, None)``: ``loss`` is the contrastive loss of the two views (``None``
        when items have no ``pixel_values_2``), and ``embeddings`` are the query encoder's features
        ``(B, F)`` of ``pixel_values`` (what the exported encoder gives), only when predictions are asked
        for (:meth:`predict`). MoCo's ``(B, 1 + K)`` logits are never kept, so an evaluation over 10,000
        images at ``K = 65536`` holds no 2.6 GB of logits. The contrastive metrics of the batch go into
        the evaluation's running metrics (``eval_contrastive_top1``, ``eval_pos_cosine``...).
        """
        inputs = self._prepare_inputs(inputs)
        loss, features = None, None
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad(), self.compute_loss_context_manager():
            if "pixel_values_2" in inputs:
                outputs = model(pixel_values=inputs["pixel_values"], pixel_values_2=inputs["pixel_values_2"])
                loss = outputs.loss.detach().float()
                self._eval_metrics.update(outputs)
            if not prediction_loss_only:
                features = unwrapped.encoder(inputs["pixel_values"]).float()  # (B, F)
        return loss, features, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Trainer's loop (global RNG state restored afterwards), with the contrastive metrics of the evaluated
        pairs added as ``{metric_key_prefix}_contrastive_top1``, ``_pos_cosine``, ``_neg_cosine``, ``_embedding_std``,
        ``_num_negatives`` (averaged over batches and processes)."""
        self._eval_metrics = ContrastiveMetrics(self.accelerator.unwrap_model(self.model).config.temperature)
        # The DataLoader draws its base seed from the global RNG: fork it, so that evaluating mid-training
        # leaves the training run's random stream (split-BN permutations, dropout) exactly as it was.
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        if self._eval_metrics.count:
            metrics = self._eval_metrics.compute_and_reset()
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in metrics.items()})
        return output

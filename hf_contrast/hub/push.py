"""Push an encoder export to the Hugging Face Hub: the repo root holds the timm folder and its card.

The export is written locally first; only then is the network touched, so a missing token, an
unreachable endpoint or a rejected upload loses nothing: :class:`HubPushError` says what to change
and where the export lies, ready to be pushed again with ``push_encoder_to_hub(path, repo_id)``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .. import distributed
from .export import CONFIG_NAME, WEIGHTS_NAME, export_encoder, split_source

logger = logging.getLogger(__name__)


class HubPushError(ValueError):
    """The upload failed; the local export is intact.

    Attributes:
        export_dir: the folder that was to be pushed; push it again with
            ``push_encoder_to_hub(export_dir, repo_id)``.
    """

    def __init__(self, message: str, export_dir: Path):
        super().__init__(message)
        self.export_dir = export_dir


def check_repo_id(repo_id: str | None) -> str:
    """Return ``repo_id`` if it is a valid Hub model id ``"ORG/NAME"`` (or ``"NAME"``).

    Raises:
        ValueError: ``repo_id`` is missing or malformed; the message says what a valid one looks like.
    """
    if not repo_id:
        raise ValueError("No Hub repo id: pass repo_id='ORG/NAME' (training scripts: --hub_model_id ORG/NAME).")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(
            f"hub_model_id={repo_id!r} is not a valid Hub repo id: use 'ORG/NAME' with letters, digits, '-', '_' "
            f"and '.' only, at most 96 characters ({e})."
        ) from None
    if repo_id.count("/") > 1:
        raise ValueError(f"hub_model_id={repo_id!r} is not a valid Hub repo id: use 'ORG/NAME' (one '/').")
    return repo_id


def _blocker(repo_id: str, token: str | None) -> str | None:
    """Why a push to ``repo_id`` cannot start (offline mode, no token), or ``None``."""
    if constants.HF_HUB_OFFLINE:
        return f"Cannot push to {repo_id}: offline mode is on (HF_HUB_OFFLINE=1); unset it."
    if not (token or get_token()):
        return (f"Cannot push to {repo_id}: no Hugging Face token. Run `hf auth login`, set HF_TOKEN, "
                "or pass token= (training scripts: --hub_token).")
    return None


def check_can_push(repo_id: str | None, token: str | None = None) -> str:
    """Fail fast, before any training, if a push could not happen: the repo id is malformed, there
    is no token, or offline mode is on. Returns the repo id.

    Raises:
        ValueError: naming what to change.
    """
    repo_id = check_repo_id(repo_id)
    if reason := _blocker(repo_id, token):
        raise ValueError(reason)
    return repo_id


def _is_main_process(trainer) -> bool:
    if trainer is not None:
        return trainer.is_world_process_zero()
    return distributed.rank() == 0


def push_encoder_to_hub(source, repo_id: str | None = None, *, token: str | None = None, private: bool | None = None,
                        commit_message: str = "Upload encoder exported by hf_contrast", revision: str | None = None,
                        export_dir: str | Path | None = None, endpoint: str | None = None, **export_kwargs):
    """Export the query encoder of ``source`` with its model card and upload it to the root of ``repo_id``.

    Creates the repo if needed and updates it if it exists. Runs on the main process only (other
    processes return ``None`` at once).

    Args:
        source: a :class:`~hf_contrast.ContrastiveTrainer`, a contrastive model, or the path of an
            existing export folder (pushed as it is).
        repo_id: ``"ORG/NAME"``; default ``trainer.args.hub_model_id``.
        token: a token with write access; default ``trainer.args.hub_token``, then ``HF_TOKEN`` or
            the stored login.
        private: visibility of a repo that is created (ignored if it exists).
        commit_message: the commit message.
        revision: the branch to commit to (default ``main``).
        export_dir: where to write the export first (new or empty). Default: a temporary folder,
            removed after a successful push and kept (its path in the error) after a failed one.
        endpoint: the Hub URL; default ``HF_ENDPOINT``.
        export_kwargs: passed to :func:`~hf_contrast.export_encoder` (``augmentation``, ``knn_top1``...).

    Returns:
        The ``CommitInfo`` of the upload, or ``None`` on a non-main process.

    Raises:
        ValueError: ``repo_id`` is missing or malformed, or ``export_dir`` is not empty.
        HubPushError: no token, offline mode, unreachable endpoint or rejected upload; the export is kept.
    """
    is_path = isinstance(source, (str, Path))
    trainer = None if is_path else split_source(source)[1]
    if not _is_main_process(trainer):
        return None
    args = getattr(trainer, "args", None)
    repo_id = check_repo_id(repo_id or getattr(args, "hub_model_id", None))
    token = token or getattr(args, "hub_token", None)
    if private is None:
        private = getattr(args, "hub_private_repo", None)

    temporary = False
    if is_path:
        folder = Path(source)
        if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
            raise ValueError(f"{folder} is not an encoder export (no {CONFIG_NAME} and {WEIGHTS_NAME}): "
                             "pass a folder written by export_encoder, a model or a trainer.")
    else:
        temporary = export_dir is None
        folder = Path(export_dir) if export_dir is not None else Path(tempfile.mkdtemp(prefix="hf_contrast_export_"))
        export_kwargs.setdefault("repo_id", repo_id)
        export_encoder(source, folder, overwrite=temporary, **export_kwargs)

    endpoint = endpoint or constants.ENDPOINT
    keep = (f"The export is intact at {folder.resolve()}; push it again with "
            f"hf_contrast.push_encoder_to_hub({str(folder.resolve())!r}, {repo_id!r}).")
    if reason := _blocker(repo_id, token):
        logger.error(f"{reason} {keep}")
        raise HubPushError(f"{reason} {keep}", folder)
    api = HfApi(endpoint=endpoint, token=token, library_name="hf_contrast")
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        # delete_patterns="*": files of an earlier push that this export lacks are deleted in the same
        # commit, so the repo holds exactly the export (a stale plot or weights file would mislead)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message, revision=revision,
                                 delete_patterns="*")
    except Exception as e:  # network, HTTP and authentication errors of every kind
        logger.error(f"Push to {repo_id} failed. {keep}")
        raise HubPushError(f"Pushing the encoder to {repo_id} at {endpoint} failed ({type(e).__name__}: {e}). "
                           f"Check the endpoint, your network and the token's write access. {keep}", folder) from e
    logger.info(f"Pushed the encoder export to {endpoint}/{repo_id} ({info.oid})")
    if temporary:
        shutil.rmtree(folder, ignore_errors=True)
    return info

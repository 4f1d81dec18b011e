"""Hub names: what a Hugging Face Hub repo id must be, said in one line (push's REPO_ID, the card's
base_model and --base-model on every command that records it). Imports huggingface_hub only when a
name is checked, and nothing of this package: the options module checks --base-model with it."""

from __future__ import annotations


def repo_id_error(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a Hub repo id naming its namespace (namespace/name), in one line as
    ``quantize push`` says it; None when it is one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return f"REPO_ID {repo_id!r}: {str(e).splitlines()[0]}; use namespace/name, e.g. my-org/GLM-5-W4A16"
    if repo_id.count("/") != 1:
        return f"REPO_ID {repo_id!r}: name the namespace too (namespace/name, e.g. my-org/{repo_id})"
    return None

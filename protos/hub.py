"""`--model ORG/NAME[@REVISION]`: a Hugging Face hub id, resolved to a snapshot directory of
huggingface_hub's cache (downloaded when the hub can be reached; HF_HOME, HF_HUB_CACHE and
HF_HUB_OFFLINE as huggingface_hub reads them). Every parser of `--model` takes `model_path` as
its type, so each process that reads the checkpoint resolves it once, as it parses, and a
parent hands its children the directory, not the id."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# huggingface_hub's rule for a repo id (utils/_validators.py): each part starts and ends with a
# word character, at most 96 characters in all, no "--" or "..". A revision is a branch, a tag
# or a commit, and a branch may hold slashes (refs/pr/1).
_PART = r"\w(?:[\w.-]*\w)?"
_HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>\S+))?")
# The cache's folder of a model repo: models--ORG--NAME (huggingface_hub's repo_folder_name).
_FOLDER_PREFIX = "models--"


class HubError(OSError):
    """A hub id that resolves to no snapshot; the text is the one sentence to print."""


def hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `text` has the form ORG/NAME[@REVISION], else None."""
    m = _HUB_ID.fullmatch(text)
    if m is None or len(m["repo"]) > 96 or "--" in m["repo"] or ".." in m["repo"]:
        return None
    return m["repo"], m["revision"]


def model_path(text: str) -> Path:
    """`--model`'s argparse type. What exists on disk is a path; ORG/NAME[@REVISION] is the
    snapshot directory it resolves to; anything else stays a path, which the command refuses
    as it refuses any missing checkpoint."""
    path = Path(text)
    ref = None if path.exists() else hub_id(text)
    if ref is None:
        return path
    try:
        return snapshot(*ref)
    except HubError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def snapshot(repo: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo` at `revision` (default: main), from the hub when it can
    be reached, else from the cache; HubError with a sentence when neither has it."""
    name = f"{repo}@{revision}" if revision else repo
    try:
        # Imported only for a hub id: `met` parses a path without loading it.
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise HubError(f"{name} is a hub id, and that needs the huggingface_hub package") from None
    try:
        return Path(snapshot_download(repo, revision=revision))
    except errors.RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {revision!r} on the Hugging Face hub") from None
    except errors.RepositoryNotFoundError:
        raise HubError(
            f"{repo} is not on the Hugging Face hub, or is private or gated and needs a token "
            "(HF_TOKEN)"
        ) from None
    except errors.LocalEntryNotFoundError as e:
        where = "only partly in" if isinstance(e, errors.IncompleteSnapshotError) else "not in"
        hub = (
            "is offline (HF_HUB_OFFLINE is set)"
            if constants.is_offline_mode()
            else "could not be reached"
        )
        raise HubError(
            f"{name} is no path on disk and {where} the Hugging Face cache at "
            f"{constants.HF_HUB_CACHE}, and the hub {hub}"
        ) from None
    except (OSError, ValueError) as e:
        # The hub's messages run over lines; the first says what went wrong.
        why = str(e).partition("\n")[0] or type(e).__name__
        raise HubError(f"{name} could not be fetched from the Hugging Face hub: {why}") from None


def model_name(directory: Path) -> str:
    """What a service calls the checkpoint in `directory`: ORG/NAME for a snapshot of the hub's
    cache (models--ORG--NAME/snapshots/REVISION), else the directory's own name."""
    path = directory.resolve()
    folder = path.parent.parent.name
    if path.parent.name == "snapshots" and folder.startswith(_FOLDER_PREFIX):
        return folder.removeprefix(_FOLDER_PREFIX).replace("--", "/")
    return path.name

"""The tokenizer a connection brings: the served checkpoint's files, and whether they are
another model's than those in use."""

from __future__ import annotations

import logging

from control_plane.scheduler.seq import ActiveSeq
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities, FailedPrecondition, ServingModel

log = logging.getLogger("control_plane.scheduler")


def served_by(model: ServingModel, caps: Capabilities) -> Tokenization:
    """The served checkpoint's tokenizer; files that give none are `FailedPrecondition`."""
    try:
        return Tokenization.from_files(
            model.tokenizer_files(), f"the GPU service's model {caps.model_name!r}"
        )
    except ValueError as e:
        raise FailedPrecondition(
            f"{e}; the control plane cannot tokenize for it (a --tokenizer DIR given to the "
            "control plane overrides the model's)"
        ) from None


def replaces(old: Tokenization | None, new: Tokenization) -> bool:
    """Whether `new` is another model's tokenizer than `old` (said in the log): the same
    files keep the one in use, and what was built for it."""
    if old is None or old is new or old.digest == new.digest:
        return False
    log.warning(
        "the GPU service now serves another model: %s (tokenizer files %s), where it "
        "served %s (%s); the tokenizer was reloaded",
        new.origin,
        new.digest,
        old.origin,
        old.digest,
    )
    return True


def refuse_stale(stale: list[ActiveSeq], now: Tokenization) -> None:
    """Requests tokenized for the model served before `now` end alone: their ids mean other
    text, or none, to the model served now."""
    message = (
        f"the GPU service now serves another model ({now.origin}) than the one this request "
        "was tokenized for; send it again"
    )
    for a in stale:
        a.refuse("UNAVAILABLE", message)
        a.finish("error")

"""User-facing errors: one line naming the file or tensor, what is wrong and the fix."""

from __future__ import annotations


class QuantizeError(Exception):
    """A problem with the user's input or environment. The CLI prints ``str(err)`` as one line
    and exits non-zero, without a traceback."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class CheckFailed(QuantizeError):
    """A verification found a defect in a written artifact."""

    exit_code = 1


class PeerLost(QuantizeError):
    """A rank's collective failed because another rank stopped or hangs: a consequence, so the
    launcher shows the other rank's own error before this one, whatever the clocks say."""

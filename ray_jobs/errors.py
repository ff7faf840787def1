"""The pipeline's one error type: why it cannot start or run, in one line for the command line."""
from __future__ import annotations


class PipelineError(RuntimeError):
    """The pipeline cannot start or run: Ray unreachable, shard actors not ready. One line, for the CLI."""

    def __init__(self, message: object = "pipeline error") -> None:
        from core.redact import redact

        super().__init__(redact(" ".join(str(message).split()))[:2000])

"""stragglerscope: fleet-wide straggler, hang and link diagnosis for large-model training.

``stragglerscope.instrument(job_id=..., bootstrap=..., layout=...)`` instruments
the calling training process with no other change to its code (what
``stragglerscope trace -- COMMAND`` does for every process of COMMAND).
"""


def instrument(job_id: str, bootstrap: str, **kwargs) -> None:
    """See ``ingest.autotrace.session.instrument``."""
    from ingest.autotrace.session import instrument as _instrument

    _instrument(job_id, bootstrap, **kwargs)

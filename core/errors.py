"""Error kinds that cross layers: a service's refusal that says "not now", not "never".

The storage layer raises them and the shard's checkpoint acts on them, and
neither imports the other (tests/unit/test_layers.py), so the kind lives here.
"""
from __future__ import annotations


class RetryLater(Exception):
    """Not now, through no fault of the work: a replicated store short of its quorum refuses writes
    (``storage.errors.StoreBusy``; the checkpoint keeps the results and retries, never gives them up), or the
    store cannot answer a question about a record (the shard keeps the record, unhandled and not advanced
    past, and handles it again next pass)."""

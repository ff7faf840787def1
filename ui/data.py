"""The console's only door to data: named queries of ``storage`` with short-lived caches.

Pages never write SQL against tables themselves; they ask for a named query,
so the console and `stragglerscope sql` answer the same question the same way.
Results are cached for a few seconds (fleet views) so that reruns on every
widget change do not hit the store again.
"""
from __future__ import annotations

import os
import time

import pandas as pd
import streamlit as st

FLEET_TTL_S = 15
ALERTS_TTL_S = 5
JOB_LIST_TTL_S = 300
"""The job page's picker lists the top wasting jobs: the slowest query of that page (a scan of the whole fleet)
for a list that changes slowly. A job an alert links to is added to it from the address anyway."""


def store_url() -> str:
    from core.config import load

    return os.environ.get("STRAGGLERSCOPE_STORE") or load().store.url


@st.cache_resource(show_spinner=False)
def _store(url: str):
    from storage import open_store

    store = open_store(url)
    store.setup()
    return store


def _clean(params: dict) -> dict:
    return {k: v for k, v in params.items() if v not in (None, "", [])}


@st.cache_data(ttl=FLEET_TTL_S, show_spinner=False)
def named(name: str, **params) -> pd.DataFrame:
    return _store(store_url()).run_named(name, _clean(params)).to_pandas()


@st.cache_data(ttl=ALERTS_TTL_S, show_spinner=False)
def named_live(name: str, **params) -> pd.DataFrame:
    return _store(store_url()).run_named(name, _clean(params)).to_pandas()


def now_ns() -> int:
    return time.time_ns()


def viewer_tz() -> str | None:
    """The viewer's time zone as their browser names it (None outside a browser session, e.g. AppTest)."""
    return st.context.timezone


@st.cache_data(ttl=JOB_LIST_TTL_S, show_spinner=False)
def job_choices(limit: int = 200) -> list[str]:
    """The job picker's jobs: the fleet's top wasting ones."""
    top = _store(store_url()).run_named("top_wasting_jobs", {"limit": limit}).to_pandas()
    return top["job_id"].tolist() if "job_id" in top else []


def link_shown_confidence() -> float:
    """Link findings at least this confident are the job's answer (``[alerts] link_shown_confidence``)."""
    from core.config import load

    return load().alerts.link_shown_confidence


def free_sql(sql: str) -> pd.DataFrame:
    """Read-only SQL within the ``[sql]`` limits of the configuration (``storage.sandbox``)."""
    from core.config import load

    return _store(store_url()).query(sql, limits=load().sql).to_pandas()


def query_catalogue() -> dict:
    from storage import NAMED_QUERIES

    return NAMED_QUERIES


def acknowledge(alert_ids, by: str, note: str = "", acked: bool = True) -> int:
    """Store (or undo) acknowledgements so every console and `sql` sees them; refreshes the feed."""
    from actions.alerts import acknowledge as store_acks

    n = store_acks(_store(store_url()), alert_ids, by=by, note=note, acked=acked)
    named_live.clear()
    return n


@st.cache_data(ttl=300, show_spinner="Simulating the ideal timeline…", max_entries=8)
def window_timeline(job_id: str, attempt: int, window_id: int, step: int, workers: int):
    """(frame, gzipped Perfetto JSON) of one stored window, or (None, reason) when it cannot be built."""
    import gzip

    from actions.stored_window import WindowUnavailable, stored_window
    from analyzers.whatif.timeline import document_of
    from ui.timeline_view import timeline_frame

    try:
        win = stored_window(_store(store_url()), job_id, attempt, window_id)
    except WindowUnavailable as e:
        return None, str(e)
    frame, events = timeline_frame(win.ops, win.layout, step=step, workers=workers)
    return frame, gzip.compress(document_of(events), 5)


def advise_window(job_id: str, attempt: int, window_id: int) -> str:
    """Compute and store the remedies of one window; returns a message when there is none to store."""
    from actions.advice import AdviseError, AdviseOptions, advise_and_store

    try:
        _key, remedies = advise_and_store(_store(store_url()), job_id,
                                          AdviseOptions(window_id=window_id, attempt=attempt))
    except AdviseError as e:
        return f"No advice: {e}."
    if not remedies:
        return "No remedy with a gain worth acting on for this window."
    named.clear()
    return ""


class _SharedStore:
    """The console's cached store lent to a check that opens and closes its own (``require_registered``): every
    session shares that one store, so its setup and close must not reach it."""

    def __init__(self, store):
        self._store = store

    def setup(self) -> None:
        pass

    def close(self) -> None:
        pass

    def query(self, *args, **kwargs):
        return self._store.query(*args, **kwargs)


def require_known_job(job_id: str) -> int:
    """ControlError unless the store registered ``job_id``: the command line's check of a change for one job; the
    step the change starts from on every rank of it (0: none)."""
    from actions.control import require_registered

    return require_registered(store_url(), job_id, open_store=lambda url: _SharedStore(_store(url)))

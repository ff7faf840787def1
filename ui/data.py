"""The console's only door to data: named queries of ``storage`` with short-lived caches.

Pages never write SQL against tables themselves; they ask for a named query,
so the console and `stragglerscope sql` answer the same question the same way.
Results are cached for a few seconds (fleet views) so that reruns on every
widget change do not hit the store again.
"""
from __future__ import annotations

import os

import pandas as pd
import streamlit as st

FLEET_TTL_S = 15
ALERTS_TTL_S = 5


def store_url() -> str:
    from stragglerscope.config import load

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


def free_sql(sql: str) -> pd.DataFrame:
    return _store(store_url()).query(sql).to_pandas()


def query_catalogue() -> dict:
    from storage import NAMED_QUERIES

    return NAMED_QUERIES

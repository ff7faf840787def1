"""Shared pieces of the console's pages: filters, number formats, charts.

Charts live here and in the pages, never in the analyzers (STYLE.md, 1).
"""
from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

PERIODS = {"last 24 hours": 1, "last 7 days": 7, "last 30 days": 30, "last 365 days": 365, "all time": None}


def fleet_filters() -> dict:
    """Sidebar filters shared by the fleet views; returns named-query parameters."""
    with st.sidebar:
        st.subheader("Filters")
        period = st.selectbox("Period", list(PERIODS), index=4, key="period")
        team = st.text_input("Team", key="team", placeholder="any")
        model = st.text_input("Model", key="model", placeholder="any")
        min_gpus = st.number_input("Min GPUs", min_value=0, value=0, step=8, key="min_gpus")
    days = PERIODS[period]
    params = {"team": team.strip() or None, "model": model.strip() or None, "min_gpus": int(min_gpus) or None}
    if days:
        params["since"] = int((time.time() - days * 86400) * 1e9)
    return params


def fmt(v) -> str:
    if hasattr(v, "item"):  # numpy scalars
        v = v.item()
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def bar(df: pd.DataFrame, label: str, value: str, title: str = "", zero: bool = True) -> None:
    """Horizontal bars, largest first; ``zero=False`` for ratios near 1 (slowdowns)."""
    if df.empty or label not in df or value not in df:
        st.info("No data yet.")
        return
    chart = alt.Chart(df).mark_bar().encode(
        x=alt.X(f"{value}:Q", title=value.replace("_", " "), scale=alt.Scale(zero=zero)),
        y=alt.Y(f"{label}:N", sort="-x", title=None, axis=alt.Axis(labelLimit=260, labelOverlap=False)),
        tooltip=list(df.columns),
    ).properties(title=title, height=max(160, 28 * len(df)))
    st.altair_chart(chart, width="stretch")


def heatmap(df: pd.DataFrame, x: str, y: str, value: str, title: str = "", scheme: str = "reds") -> None:
    """SMon-style heatmap: x = DP rank, y = PP rank, colour = slowdown."""
    if df.empty:
        st.info("No data yet.")
        return
    chart = alt.Chart(df).mark_rect().encode(
        x=alt.X(f"{x}:O", title=x.replace("_", " ")),
        y=alt.Y(f"{y}:O", title=y.replace("_", " "), sort="descending"),
        color=alt.Color(f"{value}:Q", scale=alt.Scale(scheme=scheme), title=value.replace("_", " ")),
        tooltip=list(df.columns),
    ).properties(title=title, height=max(160, 40 * df[y].nunique()))
    st.altair_chart(chart, width="stretch")

"""The named queries with their parameters, and read-only free SQL; CSV download."""
import streamlit as st

from ui.data import free_sql, named, query_catalogue
from ui.readable import readable_frame

st.title("SQL")


def _placeholder(p) -> str:
    """A parameter's default as a reader takes it: a time bound says 'no limit', not 2**63 - 1 nanoseconds."""
    default = getattr(p, "default", "")
    if getattr(p, "time", False) and default in (0, 2**63 - 1):
        return "no limit (an ISO date, e.g. 2026-01-31, or ns since the epoch)"
    return "required" if default is None else str(default)


catalogue = query_catalogue()
tab_named, tab_free = st.tabs(["Named queries", "Free SQL (read-only)"])

with tab_named:
    names = sorted(catalogue)
    # The fleet's headline first: a reader who opens the page sees an answer, not a table of ids.
    name = st.selectbox("Query", names, index=names.index("fleet_summary") if "fleet_summary" in names else 0)
    q = catalogue[name]
    st.caption(getattr(q, "description", ""))
    params = {}
    for p in getattr(q, "params", ()) or ():
        pname = getattr(p, "name", p)
        val = st.text_input(pname, key=f"p-{name}-{pname}", placeholder=_placeholder(p),
                            help=getattr(p, "description", None) or None)
        if val.strip():
            params[pname] = val.strip()
    try:
        df = named(name, **params)
    except Exception as e:  # bad parameter: show it, keep the page
        st.error(str(e).splitlines()[0])
    else:
        st.dataframe(readable_frame(df), width="stretch", hide_index=True)
        st.caption("Wall-clock times (*_ns) are shown in UTC; the CSV keeps them in ns since the epoch.")
        st.download_button("Download CSV", df.to_csv(index=False), file_name=f"{name}.csv", mime="text/csv")

with tab_free:
    sql = st.text_area("SQL", "SELECT job_id, window_id, slowdown FROM windows ORDER BY slowdown DESC LIMIT 20")
    if st.button("Run"):
        try:
            df = free_sql(sql)
        except Exception as e:
            st.error(str(e).splitlines()[0])
        else:
            st.dataframe(readable_frame(df), width="stretch", hide_index=True)
            st.download_button("Download CSV", df.to_csv(index=False), file_name="query.csv", mime="text/csv")

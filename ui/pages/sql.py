"""The named queries with their parameters, and read-only free SQL; CSV download."""
import streamlit as st

from ui.data import free_sql, named, query_catalogue

st.title("SQL")
catalogue = query_catalogue()
tab_named, tab_free = st.tabs(["Named queries", "Free SQL (read-only)"])

with tab_named:
    name = st.selectbox("Query", sorted(catalogue))
    q = catalogue[name]
    st.caption(getattr(q, "description", ""))
    params = {}
    for p in getattr(q, "params", ()) or ():
        pname = getattr(p, "name", p)
        val = st.text_input(pname, key=f"p-{name}-{pname}", placeholder=str(getattr(p, "default", "")))
        if val.strip():
            params[pname] = val.strip()
    try:
        df = named(name, **params)
    except Exception as e:  # bad parameter: show it, keep the page
        st.error(str(e).splitlines()[0])
    else:
        st.dataframe(df, width="stretch", hide_index=True)
        st.download_button("Download CSV", df.to_csv(index=False), file_name=f"{name}.csv", mime="text/csv")

with tab_free:
    sql = st.text_area("SQL", "SELECT job_id, window_id, slowdown FROM windows ORDER BY slowdown DESC LIMIT 20")
    if st.button("Run"):
        try:
            df = free_sql(sql)
        except Exception as e:
            st.error(str(e).splitlines()[0])
        else:
            st.dataframe(df, width="stretch", hide_index=True)
            st.download_button("Download CSV", df.to_csv(index=False), file_name="query.csv", mime="text/csv")

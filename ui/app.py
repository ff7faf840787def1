"""The stragglerscope console: `streamlit run ui/app.py` (the CLI's `console` and `demo` do this).

Reads the store named by STRAGGLERSCOPE_STORE (or the configured store.url)
through ``ui.data`` only.
"""
import sys
from pathlib import Path

import streamlit as st

# Streamlit runs this file as a script: make the project importable.
_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

st.set_page_config(page_title="stragglerscope", layout="wide")

_PAGES = _ROOT / "ui" / "pages"
nav = st.navigation([
    st.Page(str(_PAGES / "fleet.py"), title="Fleet", default=True),
    st.Page(str(_PAGES / "alerts.py"), title="Alerts"),
    st.Page(str(_PAGES / "job.py"), title="Job"),
    st.Page(str(_PAGES / "hosts.py"), title="Hosts"),
    st.Page(str(_PAGES / "sql.py"), title="SQL"),
])
nav.run()

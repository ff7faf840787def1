"""What the command line and the console do around the analyzers: the use cases that read results, run an
analyzer on them and store what it says (``advice``: remedies of a stored window), record what a person did
(``alerts``: acknowledgements), or read and write the files of `stragglerscope whatif` (``whatif_files``).

Between the analyzers, which never see a store or a file, and the store, which derives nothing: both front
ends call these, so `stragglerscope advise` and the console's "Advise" button give and store the same rows.
(Not named ``app``: Streamlit puts ``ui/`` on the path, where ``app.py`` is the console's own script.)
"""

"""What the command line and the console do with a store: the use cases that read results, run an
analyzer on them and store what it says (``advice``: remedies of a stored window).

Between the analyzers, which never see a store, and the store, which derives nothing: both front ends
call these, so `stragglerscope advise` and the console's "Advise" button give and store the same rows.
"""

"""Automatic instrumentation of unchanged PyTorch training processes.

- ``session``: settings (``STRAGGLERSCOPE_TRACE_*``), the wrapper of
  ``init_process_group`` that starts a rank's session, and ``instrument()``.
- ``tracer``: the framework hooks (steps, forward/backward, pipeline stages
  and transfers, data-parallel collectives, optimizer, GC, checkpoints).
- ``imports``: run a patch right after a module is imported.
- ``boot/sitecustomize.py``: what ``stragglerscope trace`` puts on every
  child's PYTHONPATH to arm the above with no change to the training code.
"""

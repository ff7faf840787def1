"""Started by every Python process whose PYTHONPATH holds this folder (``stragglerscope trace`` puts it there).

With ``STRAGGLERSCOPE_TRACE`` set, it arms the automatic instrumentation: the
process is instrumented if and when it calls ``torch.distributed``'s
``init_process_group``; nothing is imported before that but a small hook. Then
it runs the ``sitecustomize`` this one shadows, if there is one. Nothing here
may stop the process from starting: a failure is one line on stderr.
"""
import os
import sys


def _arm() -> None:
    try:
        from ingest.autotrace.session import arm_from_env

        arm_from_env()
    except Exception as e:  # noqa: BLE001 - the training job starts regardless
        print(f"stragglerscope trace: instrumentation disabled in pid {os.getpid()}: {e!r}", file=sys.stderr)


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path (the one this file hides), as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("STRAGGLERSCOPE_TRACE"):
    _arm()
_chain()

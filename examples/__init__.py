"""Runnable training clients that feed stragglerscope: ``python -m examples.train_gloo --help``."""

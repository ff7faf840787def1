"""The pipeline on Ray: shard actors, windows, dispatch, alerts, metrics.

Ray reads this variable when it is imported: without it, Ray binds its ports on
every interface even when told 127.0.0.1 (ARCHITECTURE.md, "Loopback only").
Every path to Ray in this project goes through this package first.
"""
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

"""The pipeline on Ray: shard actors, windows, dispatch, alerts, metrics.

Ray reads this variable when it is imported: without it, Ray binds its ports on
every interface even when told 127.0.0.1 (docs/architecture.md, "Loopback only").
Every path to Ray in this project goes through this package first.

The GCS keeps a record of every finished task, up to 100,000 by default, at about
3.7 MB per 1,000 tasks: with an analysis task per window, a fleet of 3,000 small
jobs (10 windows/s) grows it by 2 MB a minute for almost three hours. 10,000
keeps the recent ones for Ray's state API and its memory flat (BENCHMARKS.md,
"3,000 jobs for 30 minutes"). Read by the GCS that ``ray.init`` starts here.
"""
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")

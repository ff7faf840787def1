"""Remedies: from a what-if diagnosis to the fix, with its gain simulated on the job's own trace.

Public API
- ``advise(ops, layout_or_info, result, link_faults=None, *, min_gain=0.01) -> list[Remedy]``:
  ranked remedies for one analysed window (repartition, repack, swap_host,
  gc_interval, drain_link, recovery_plan).
- ``Remedy``: kind, verdict, action, predicted_gain, step times before/after, details.
- ``to_tables(remedies, key, advised_ns) -> {"remedy": table}``: a batch of remedies as REMEDY rows.
- ``JobFacts``: what the trace does not carry (layers, hosts, sequences, nodes alive).
- ``plan_recovery(n_nodes_alive, layer_s, gpus_per_node, f, global_batch, ...) -> RecoveryPlan``:
  Oobleck-style pipeline templates, instantiation and batch distribution.

Modules: ``resim`` (re-simulating with changed durations), ``partition``,
``packing``, ``hosts``, ``gc_interval``, ``recovery``, ``advise``. Pure:
numpy and pyarrow only.
"""
from .advise import advise, rank
from .model import KINDS, JobFacts, Remedy, to_tables
from .recovery import PipelineTemplate, RecoveryPlan, distribute_batch, partition_layers, plan_recovery

__all__ = ["KINDS", "JobFacts", "PipelineTemplate", "RecoveryPlan", "Remedy", "advise", "distribute_batch",
           "partition_layers", "plan_recovery", "rank", "to_tables"]

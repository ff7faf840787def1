"""What the link diagnosis reports: one fault, where it sits, and why it was named."""
from __future__ import annotations

import dataclasses

KINDS = ("link", "source", "destination", "endpoint", "noncomm_slow", "comm_slow")
"""link: one directed link; source: a rank's NIC egress; destination: its ingress; endpoint: a rank's
network, direction not observable (only collectives saw it); noncomm_slow: a late sender (its own
compute); comm_slow: slow communication that could not be localised."""

SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")
"""CCL record ops of point-to-point transfers (``op`` as the exporter writes it); every other op is a collective."""


@dataclasses.dataclass(frozen=True)
class LinkFault:
    group: str
    kind: str  # one of KINDS
    src: int
    dst: int
    confidence: float
    slowdown: float
    evidence: dict

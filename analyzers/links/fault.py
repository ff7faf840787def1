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


# A network element is ("egress", rank), ("ingress", rank) or ("link", src, dst): what the localisation reasons
# about (an observation's path, a flow's data and acknowledgements). A finding names one as (kind, src, dst).
_KIND_OF_ELEMENT = {"egress": "source", "ingress": "destination", "link": "link"}


def finding_of(element: tuple) -> tuple[str, int, int]:
    """(kind, src, dst) of the finding that names ``element`` (-1 for the end a NIC or an ingress leaves open)."""
    if element[0] == "link":
        return "link", int(element[1]), int(element[2])
    return (("source", int(element[1]), -1) if element[0] == "egress" else ("destination", -1, int(element[1])))


def element_of(kind: str, src: int, dst: int) -> tuple | None:
    """The element a finding of ``kind`` names; None for a kind that names none (a late sender, an endpoint)."""
    return {"source": ("egress", src), "destination": ("ingress", dst), "link": ("link", src, dst)}.get(kind)


def element_name(element: tuple) -> str:
    """'egress 3', 'ingress 5', 'link 2>3': as evidence lists candidates."""
    return f"{element[0]} {element[1]}" if len(element) == 2 else f"link {element[1]}>{element[2]}"

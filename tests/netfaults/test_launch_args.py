"""The launcher's arguments: fault specs and the trace bootstrap it may expose (pure functions, no namespaces)."""
from __future__ import annotations

import pytest

from tests.netfaults.launch import bootstrap_ports, parse_fault


@pytest.mark.parametrize("text, want", [
    ("none", None),
    ("egress:1:20mbit", ("slow_egress", [1], "20mbit")),
    ("ingress:0:1.5gbit", ("slow_ingress", [0], "1.5gbit")),
    ("link:3:0:500kbit", ("slow_link", [3, 0], "500kbit")),
])
def test_fault_specs(text, want):
    assert parse_fault(text, 4) == want


@pytest.mark.parametrize("text, why", [
    ("slow:1:20mbit", "want egress"),
    ("egress:1", "want egress"),
    ("link:1:20mbit", "want egress"),
    ("egress:x:20mbit", "integers"),
    ("egress:4:20mbit", "within 0..3"),
    ("link:1:1:20mbit", "distinct"),
    ("egress:1:fast", "not a tc rate"),
])
def test_bad_fault_specs_say_why(text, why):
    with pytest.raises(ValueError, match=why):
        parse_fault(text, 4)


def test_bootstrap_ports_are_loopback_only():
    assert bootstrap_ports("") == []
    assert bootstrap_ports("127.0.0.1:9092, 127.0.0.1:9093") == [9092, 9093]
    for bad in ("localhost:9092", "10.0.0.1:9092", "127.0.0.1:kafka"):
        with pytest.raises(ValueError, match="127.0.0.1:PORT"):
            bootstrap_ports(bad)

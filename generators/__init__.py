"""Synthetic telemetry for tests, benchmarks and the demo: fleets, faults, downtime. Never product input."""

"""Observability: Prometheus metrics, cheap counters and histograms, and the fan-out of committed events."""

"""Rerunnable benchmarks for epd-kit (docs/benchmarks.md). Each section is `python -m bench.<name>`."""

"""Benchmarks for Phalanx (`make bench`, i.e. `python bench/run.py`)."""

"""Micro-benchmarks of router components (run as modules, e.g. ``python -m loadtest.bench.ledger_bench``)."""

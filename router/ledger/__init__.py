"""Ledger stores: in-process (default) and Redis (shared across replicas)."""

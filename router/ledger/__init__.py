"""Ledger stores: in-process (default) and Redis (shared across replicas).

Build one with :func:`router.ledger.factory.build_ledger`; the contract is in :mod:`router.ledger.base`.
"""

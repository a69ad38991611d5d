"""Placement: pure policies over an immutable :class:`~router.placement.snapshot.Snapshot`.

A policy is ``(Snapshot, RequestShape) -> list[int]``: indices into ``snapshot.ranks`` of the ranks where
the request fits now, best first (the gateway tries them in order, so a reservation that lost a race
falls through to the next). An empty list means wait or refuse; :func:`router.placement.admission.decide`
says which.
"""

"""kvrouter: a KV-aware router for MLA models served with data-parallel attention."""

__version__ = "0.1.0"

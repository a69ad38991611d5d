"""SGLang- and vLLM-compatible HTTP servers around :mod:`loadtest.engine` (``kvrouter-loadtest emulate``)."""

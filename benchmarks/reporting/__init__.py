# Copyright 2026 The aaren-hf authors. Apache-2.0.
"""The pieces of ``benchmarks/report.py``: ``collect`` (run the scripts, gather their JSON), ``plot`` (PNG figures)
and ``render`` (the Markdown report)."""

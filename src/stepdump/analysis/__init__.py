"""Analysis: pure functions that take a Run and return data (frames, findings, diffs).

Rendering (tables, HTML) lives elsewhere so these stay testable and reusable.

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

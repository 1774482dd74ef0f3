"""Rendering: turn the data that ``stepdump.analysis`` builds into text and HTML.

Nothing here reads a run by itself except the ``write_*`` conveniences, which
call the analysis function first.

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

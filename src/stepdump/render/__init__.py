"""Rendering: turn the data that ``stepdump.analysis`` builds into text and HTML.

Nothing here reads a run by itself except the ``write_*`` conveniences, which
call the analysis function first.
"""

"""The on-disk store: format constants, codecs, segment files and the SQLite catalog.

FORMAT.md at the repository root is the specification; this package implements it.

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

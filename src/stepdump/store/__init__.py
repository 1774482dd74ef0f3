"""The on-disk store: format constants, codecs, segment files and the SQLite catalog.

FORMAT.md at the repository root is the specification; this package implements it.
"""

"""The ``stepdump`` command line: a thin layer over the library, one module per command.

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

"""Reading runs: ``Run``, state dicts and restore.

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

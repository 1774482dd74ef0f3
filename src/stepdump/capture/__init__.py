"""Capture: the Recorder, what it selects, how it stages tensors and hands them to the writer.

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

"""Torch-aware helpers shared by capture and read: fingerprints, stats, RNG state,
layout naming, DTensor detection, typed JSON and the dtype table.

Layering: ``core`` imports only ``errors`` and ``store.format``; capture, read,
analysis and render import ``core``, never each other downwards-up (see
docs/architecture.md).

Internal; public names are in stepdump/__init__.py, stepdump.checks, stepdump.export.
"""

"""Reliability harnesses shared by tests/test_reliability_*.py and `make soak`.

Nothing here is collected by pytest (no ``test_`` files); the test files and
``tests/reliability/soak.py`` import these modules.
"""

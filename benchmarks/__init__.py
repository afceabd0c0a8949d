"""Benchmarks: scheduler speed and quality against slime's algorithms, report drift.

Run ``make bench`` (``python -m benchmarks.run``).
"""

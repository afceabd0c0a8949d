"""Measurement: per-micro-batch calibration and the device benchmark.
"""

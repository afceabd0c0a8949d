"""What a schedule is worth: quality tables, sweeps and policy tables, simulated step times.

Pure; built on :mod:`varbatch_kit.core` and :mod:`varbatch_kit.policies`.
"""

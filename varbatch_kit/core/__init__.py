"""The data model and the schedule builder: rollouts, model shapes, layouts, schedules.

Pure (numpy; no torch.distributed, no plotting). Imports only
:mod:`varbatch_kit.policies` below it.
"""

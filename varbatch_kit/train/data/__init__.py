"""A run's data: rollout columns and tokens, advantages.
"""

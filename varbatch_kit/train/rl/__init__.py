"""The closed RL loop: generation and the loop around training.
"""

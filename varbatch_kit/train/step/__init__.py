"""One step on one rank: the packed batch, the train step and the log-prob pass, a CP
rank's response share, the pipeline schedule, micro-batch timing.
"""

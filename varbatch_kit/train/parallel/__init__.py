"""Processes and their groups: devices, the CPU shim over megatron's CUDA calls, process
setup, tensor parallelism and all-gather context parallelism.
"""

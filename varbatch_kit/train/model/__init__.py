"""The model: megatron's GPT, attention and rope, pipeline stages, Hugging Face weights in
and out, SmolLM2.
"""

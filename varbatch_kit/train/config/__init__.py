"""What a training run asks for: ``TrainConfig`` and its sub-configs, the model (a Hugging
Face checkpoint's metadata read and checked), the parallel layout, the field and pipeline
checks, the CLI's flags. Pure: no torch, no engine imports.
"""

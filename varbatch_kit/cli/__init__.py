"""The ``varbatch-kit`` command line (``schedule``, ``train``, ``compare``, ``demo``, ...)."""

from varbatch_kit.cli.main import main

__all__ = ["main"]

"""Stable entry point: ``python -m varbatch_kit.demo`` runs :func:`varbatch_kit.cli.demo.main`.

Imported, ``varbatch_kit.demo`` is :mod:`varbatch_kit.cli.demo` (the same module).
"""

import sys

from varbatch_kit.cli import demo as _module

if __name__ == "__main__":
    sys.exit(_module.main())
else:
    sys.modules[__name__] = _module

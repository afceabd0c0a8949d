"""Copy the browser tests' explorer screenshots into docs/ as small PNGs for the README.

    make test                       # tests/browser writes build/screenshots/*.png
    python scripts/doc_screenshots.py

With Pillow importable, the pictures are quantised to a 128-colour palette
(about a third of the size); without it they are copied as they are.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = ("packing_explorer", "balance_explorer")


def main() -> int:
    try:
        from PIL import Image
    except ImportError:
        Image = None
    for name in NAMES:
        src = REPO / "build" / "screenshots" / f"{name}.png"
        dst = REPO / "docs" / f"{name}.png"
        if not src.exists():
            print(f"{src} is missing: run the browser tests first (make test)", file=sys.stderr)
            return 1
        dst.parent.mkdir(exist_ok=True)
        if Image is None:
            shutil.copyfile(src, dst)
        else:
            with Image.open(src) as im:
                im.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT,
                                           dither=Image.Dither.NONE).save(dst, optimize=True)
        print(f"{dst.relative_to(REPO)}: {dst.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pieces of the demo's HTML export, without running a notebook: the index page's style, the
kernel's stderr filter, text-mode progress bars in the demo's kernel setup."""

import io
import subprocess
import sys

from varbatch_kit.cli import demo


def test_index_table_scrolls_in_a_small_font_instead_of_being_cut_off(tmp_path):
    wide = "policy " + "x" * 190
    page = demo.write_index(tmp_path / "index.html", "T", [("a.html", "a", "b")],
                            preformatted=wide).read_text()
    assert f"<style>{demo.INDEX_CSS}</style>" in page
    pre = demo.INDEX_CSS.split("pre{", 1)[1].split("}", 1)[0]
    assert "overflow-x:auto" in pre and "font-size:12px" in pre and "max-width:100%" in pre
    assert f"<pre>{wide}</pre>" in page


def test_kernel_stderr_loses_only_the_tcp_warning():
    lines = [b"[IPKernelApp] WARNING | Kernel is running over TCP without encryption. All "
             b"communication ... encryption.\n", b"a real kernel error\n",
             b"[IPKernelApp] WARNING | something else\n"]
    out = io.StringIO()
    demo.copy_kernel_stderr(io.BytesIO(b"".join(lines)), out)
    assert out.getvalue() == "a real kernel error\n[IPKernelApp] WARNING | something else\n"


def test_demo_kernel_setup_makes_tqdm_auto_a_text_bar_on_stdout():
    """After the setup cell, a tqdm.auto bar is text on stdout (its final state survives the
    HTML export) and plotly renders through the demo's renderer."""
    code = (f"exec({demo._SETUP!r})\n"
            "import sys, tqdm.auto, tqdm.std\n"
            "from tqdm.auto import tqdm, trange\n"
            "import plotly.io as pio\n"
            "print('renderer', pio.renderers.default)\n"
            "for _ in tqdm(range(272), desc='bar'): pass\n"
            "for _ in trange(3): pass\n"
            "print('\\nclass', tqdm.__mro__[1].__module__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "renderer plotly_mimetype+varbatch_kit_demo" in res.stdout
    assert "272/272" in res.stdout and "3/3" in res.stdout  # the final states, on stdout
    assert "class tqdm.std" in res.stdout
    assert "272/272" not in res.stderr

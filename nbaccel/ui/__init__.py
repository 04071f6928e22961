"""The notebook UI: the config panel and the live dashboard (ipywidgets; never torch).

Importing this package imports nothing else: ``nbaccel.launch`` asks ``nbaccel.ui.choose``
(no ipywidgets import) how to show a run, which loads ``nbaccel.ui.attach`` (ipywidgets;
then matplotlib on the dashboard's own thread) only when widgets are shown.

- ``kernel``: whether this runs in a Jupyter kernel, and whether ipywidgets is installed.
- ``choose``: widgets or text for a launch (``dashboard="auto"`` / "text" / True / False),
  as the ``show`` callback the launcher calls with the new run.
- ``attach``: ``attach_dashboard(run, ...)`` (what a launch in a kernel does) and
  ``dashboard_for(run)``, to find a run's dashboard again.
- ``dashboard/``: the live dashboard — ``board.Dashboard`` (the run subscriber and its UI
  thread, which makes every widget write), ``widgets`` (the widget tree, each part tagged
  with an ``nbaccel-*`` CSS class), ``model`` (its state built from run events, plain data)
  and ``parts`` (memory readings, log tails, series, failures), ``cell_output`` (what the
  cell shows, then the static summary), ``compare`` (earlier runs of the same
  ``runs_dir``), ``text`` (header, summary, HTML), ``memory`` (NVML per GPU, psutil per CPU
  worker), ``plots`` (PNG frames with matplotlib's Agg) and ``step_panel``.
- ``kept_panel``: the line and Release button a ``keep_workers`` launch leaves under its
  dashboard (the kept workers and each rank's memory).
- ``sweep_board``: ``nbaccel.sweep``'s one board (a row per trial, the curves overlaid, Stop
  trial and Stop all, then its summary), drawing what ``sweep_summary`` renders (the table
  as HTML and text, the best trial's line, the curves as a PNG).
- ``panel/``: ``nbaccel.ConfigPanel`` (``config_panel``, ``config_widgets``) and its groups
  as the wizard asks them (``config_groups``).
"""

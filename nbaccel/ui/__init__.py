"""The notebook UI: the config panel and the live dashboard (ipywidgets; never torch).

Importing this package imports nothing else: ``nbaccel.launch`` asks ``nbaccel.ui.choose``
(no ipywidgets import) how to show a run, which loads ``nbaccel.ui.attach`` (ipywidgets;
then matplotlib on the dashboard's own thread) only when widgets are shown.

- ``kernel``: whether this runs in a Jupyter kernel, and whether ipywidgets is installed.
- ``choose``: widgets or text for a launch (``dashboard="auto"`` / "text" / True / False),
  as the ``show`` callback the launcher calls with the new run.
- ``attach``: ``attach_dashboard(run, ...)`` (what a launch in a kernel does) and
  ``dashboard_for(run)``, to find a run's dashboard again.
- ``dashboard``: ``Dashboard``, the run subscriber and its UI thread (all widget writes).
- ``dashboard_widgets``: the widget tree, each part tagged with an ``nbaccel-*`` CSS class.
- ``dashboard_model``: the dashboard's state built from run events (plain data);
  ``dashboard_parts`` its building blocks (memory readings, log tails, series, failures).
- ``dashboard_output``: the dashboard's cell outputs (the widgets, then the static summary).
- ``compare``: earlier runs of the same ``runs_dir``, overlaid on the curve when picked.
- ``dashboard_text``: the header line, the summary text and the widgets' HTML.
- ``memory``: memory readings in the parent (NVML per GPU, psutil per CPU worker).
- ``plots``: PNG frames (curves, memory bars, the final summary) with matplotlib's Agg.
- ``config_panel``, ``config_widgets``: ``nbaccel.ConfigPanel``; ``config_groups``: its
  groups (as the wizard asks) and the fields this machine makes irrelevant.
"""

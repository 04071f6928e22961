"""The notebook UI: the config panel and the live dashboard (ipywidgets; never torch).

Importing this package imports nothing else: the launcher asks ``nbaccel.ui.choose``
(stdlib only) whether to show widgets, and loads ``nbaccel.ui.dashboard`` (ipywidgets,
then matplotlib on the dashboard's own thread) only when it does.

- ``choose``: widgets or text for a launch (``dashboard="auto"`` / "text" / True / False).
- ``dashboard_model``: the dashboard's state built from run events (plain data).
- ``memory``: memory readings in the parent (NVML per GPU, psutil per CPU worker).
- ``plots``: PNG frames (curves, memory bars, the final summary) with matplotlib's Agg.
- ``dashboard``: the ipywidgets view, ``attach_dashboard(run)`` and ``dashboard_for(run)``.
- ``config_panel``, ``config_widgets``: ``nbaccel.ConfigPanel``.
"""

"""The live dashboard of a run: its model (plain data built from run events), widgets, text,
plots, memory readings, the step breakdown panel, earlier runs to compare, and what stays in
the cell when the run ends. ``board.Dashboard`` owns every widget write from one UI thread.

Imports nothing of ``nbaccel.ui`` outside this folder.
"""

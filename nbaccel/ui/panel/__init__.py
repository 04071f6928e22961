"""``nbaccel.ConfigPanel``: the config panel's widgets, made from the one schema, and its
groups (as the wizard asks them) with the fields this machine makes irrelevant.

Imports nothing of ``nbaccel.ui`` outside this folder.
"""

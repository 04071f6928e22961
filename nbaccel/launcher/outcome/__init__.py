"""How a run ends: which rank really failed, the signals that stop the others, the
exception the parent raises, and the attempts of a run that torch elastic restarts.

Plain data and the parent's decisions; imports nothing of the launcher outside this folder.
"""

"""The environment variables nbaccel reads that are not launch options (no Config field).

Constants only, importing nothing: ``import nbaccel`` reads ``PREWARM_VAR`` before it starts
the helper, and everything it imports first delays that start (the config schema, ~40 ms).

>>> sorted(NON_OPTION_VARS)
['NBACCEL_CONFIG', 'NBACCEL_HOME', 'NBACCEL_PREWARM']
"""

# Whether ``import nbaccel`` in a Jupyter kernel starts the helper process at once (read by
# nbaccel.launcher.prewarm).
PREWARM_VAR = "NBACCEL_PREWARM"
# A YAML config file to read (nbaccel.config.resolve) and the folder of the default one
# (nbaccel.config.files).
CONFIG_FILE_VAR = "NBACCEL_CONFIG"
HOME_VAR = "NBACCEL_HOME"
NON_OPTION_VARS = frozenset({CONFIG_FILE_VAR, HOME_VAR, PREWARM_VAR})

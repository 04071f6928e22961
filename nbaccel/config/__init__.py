"""The one configuration schema and everything that reads or writes it.

- ``schema``: the ``Config`` dataclass (types, choices, help) and its flat ``options()``;
  ``sections``: its nested ``fsdp`` / ``deepspeed`` / ``dynamo`` parts; ``field_values``:
  how a field's value is written and parsed.
- ``resolve``: defaults < files < environment < code, each value's source recorded.
- ``files``: nbaccel's YAML and Accelerate's ``default_config.yaml``.
- ``display``: how the wizard, the widget panel and ``config show`` present a field.
- ``accelerator_options``: ``Accelerator``'s arguments and Accelerate's objects applied to a
  Config.
- ``accelerate/``: Accelerate's faces of the schema — its YAML keys and environment
  variables (``compat``), enums, ``ProjectConfiguration`` and friends (``configs``), kwargs
  handlers, plugins (``DeepSpeedPlugin``, ``FullyShardedDataParallelPlugin``) and its
  ``notebook_launcher`` keywords.
- ``deepspeed/``: a DeepSpeed JSON config generated or read (``settings``), checked
  (``checks``) and its ``"auto"`` values filled (``placeholders``).

Plain data, stdlib (and pyyaml) only: both the parent and the workers import it.
"""

from nbaccel.config.schema import (
    Config,
    DeepSpeedOptions,
    DynamoOptions,
    FSDPOptions,
    Option,
    options,
)

__all__ = ["Config", "DeepSpeedOptions", "DynamoOptions", "FSDPOptions", "Option", "options"]

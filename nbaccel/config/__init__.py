"""The one configuration schema and everything that reads or writes it.

- ``schema``: the ``Config`` dataclass (types, choices, help) and its flat ``options()``;
  ``sections``: its nested ``fsdp`` / ``deepspeed`` / ``dynamo`` parts.
- ``resolve``: defaults < files < environment < code, each value's source recorded.
- ``files``: nbaccel's YAML and Accelerate's ``default_config.yaml``;
  ``accelerate_compat``: Accelerate's names, both ways.
- ``deepspeed`` / ``deepspeed_checks``: a DeepSpeed JSON config, read and checked.
- ``display``: how the wizard, the widget panel and ``config show`` present a field.
- Accelerate's configuration objects, same names and keywords: ``plugins`` / ``fsdp_plugin``
  (``DeepSpeedPlugin``, ``FullyShardedDataParallelPlugin``), ``kwargs_handlers``,
  ``accelerator_configs`` (``ProjectConfiguration``, ``DataLoaderConfiguration``); and
  ``accelerator_options``, which applies them with ``Accelerator``'s arguments to a Config.

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

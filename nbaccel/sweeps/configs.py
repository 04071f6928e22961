"""Where a sweep's trial configs come from: a list of dicts, a grid (a dict of lists: every
combination, in order), or an Optuna study (ask and tell in the kernel: ``space(trial)``
turns each asked trial into a config). Optuna is never imported here: the study given is
used through its own methods.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


class Configs:
    """The trials' configs, one at a time (``next_config``), each with its Optuna trial when
    the source is a study (else None)."""

    def __init__(
        self,
        source: Any,
        space: Callable[[Any], Mapping[str, Any]] | None = None,
        n_trials: int | None = None,
    ) -> None:
        self.study = source if _is_study(source) else None
        self._space = space
        if self.study is not None:
            if space is None or n_trials is None:
                raise ValueError(
                    "a sweep over an Optuna study needs space= (a function of an Optuna trial "
                    "returning the trial's config: lambda trial: {'lr': trial.suggest_float("
                    "'lr', 1e-4, 1e-1, log=True)}) and n_trials= (how many trials to run)."
                )
            self.total: int = n_trials
            self._fixed: Iterator[dict[str, Any]] = iter(())
        else:
            if space is not None or n_trials is not None:
                raise ValueError(
                    "space= and n_trials= belong to a sweep over an Optuna study; a list or a "
                    "grid of configs names every trial itself."
                )
            fixed = expand(source)
            self.total = len(fixed)
            self._fixed = iter(fixed)
        self._asked = 0

    def next_config(self) -> tuple[dict[str, Any], Any] | None:
        """The next trial's config and its Optuna trial (None for a list or grid), or None
        when every trial was handed out. A study is asked only now, when a slot is free, so
        its sampler sees every trial finished so far."""
        if self._asked >= self.total:
            return None
        self._asked += 1
        if self.study is None:
            return next(self._fixed), None
        trial = self.study.ask()
        assert self._space is not None
        return dict(self._space(trial)), trial

    def tell(self, optuna_trial: Any, state: str, value: float | None) -> None:
        """Tell the study how a trial ended: its value (the metric's last), pruned, or failed
        (a trial that succeeded without logging the metric counts as failed)."""
        if self.study is None or optuna_trial is None:
            return
        if state == "succeeded" and value is not None:
            self.study.tell(optuna_trial, value)
            return
        states = _trial_states()
        self.study.tell(optuna_trial, state=states.PRUNED if state == "pruned" else states.FAIL)


def expand(source: Any) -> list[dict[str, Any]]:
    """A list of configs as given, or a grid's every combination (the last key varying
    fastest, as nested loops would).

    >>> expand({"lr": [0.1, 0.01], "batch": [16, 32]})  # doctest: +NORMALIZE_WHITESPACE
    [{'lr': 0.1, 'batch': 16}, {'lr': 0.1, 'batch': 32}, {'lr': 0.01, 'batch': 16},
     {'lr': 0.01, 'batch': 32}]
    >>> expand([{"lr": 0.1}])
    [{'lr': 0.1}]
    """
    if isinstance(source, Mapping):
        keys = list(source)
        values: list[Sequence[Any]] = []
        for key in keys:
            choices = source[key]
            if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
                raise TypeError(
                    f"a grid names each key's choices as a list: {key}={choices!r} is not one "
                    f"(write {key}=[{choices!r}] for a single value)."
                )
            values.append(choices)
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        configs = list(source)
        for index, config in enumerate(configs):
            if not isinstance(config, Mapping):
                raise TypeError(
                    f"configs[{index}] is a {type(config).__name__}: each trial's config is a "
                    "dict of the values train(config) reads."
                )
        return [dict(config) for config in configs]
    raise TypeError(
        f"configs is a {type(source).__name__}: give a list of dicts, a grid (a dict of "
        "lists) or an Optuna study (with space= and n_trials=)."
    )


def _is_study(source: Any) -> bool:
    return all(callable(getattr(source, name, None)) for name in ("ask", "tell", "optimize"))


def _trial_states() -> Any:
    """Optuna's ``TrialState`` (loaded by whoever made the study)."""
    optuna = sys.modules["optuna"]
    return optuna.trial.TrialState

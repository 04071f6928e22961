"""What interactive workers do with a trained model, on each rank (``serve``'s operations
``state_dict`` and ``map``; the kernel's side is ``after_training.py``).

``state_dict``: which model (``find_model``) and its entries unwrapped (``full_entries``);
``state_export`` writes them into the kernel's shared memory.

``map``: ``fn(batch)`` over a dataset split across the ranks as a prepared ``DataLoader``
splits an unshuffled one (``rank_batches``: global batch ``b`` goes to rank ``b % world``,
the last round padded from the start so every rank runs as many), under
``torch.inference_mode`` (a module in eval mode meanwhile). Each rank returns its outputs,
on the CPU and concatenated, with its batches' sizes; the kernel puts the batches back in
the dataset's order (``after_training.in_dataset_order``) and drops the padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nbaccel.context import active_session
from nbaccel.launcher.interactive.after_training import joined


def find_model(name: str | None, namespace: Mapping[str, Any]) -> torch.nn.Module:
    """The model a call names (an expression in the rank's namespace: ``"model"``,
    ``"result['model']"``), or by default: the first model the Accelerator prepared, else
    the module the function returned (alone, or the one module in what it returned)."""
    if name is not None:
        found = eval(name, dict(namespace))  # the user's own expression, on their own rank
        if not isinstance(found, torch.nn.Module):
            raise TypeError(f"{name!r} is a {type(found).__name__} on this rank, not a module")
        return found
    accelerator = _accelerator()
    if accelerator is not None and accelerator._prepared.models:
        model: torch.nn.Module = accelerator._prepared.models[0]
        return model
    result = namespace.get("result")
    if isinstance(result, torch.nn.Module):
        candidates = [result]
    elif isinstance(result, Mapping):  # the one module in what the function returned
        candidates = [v for v in result.values() if isinstance(v, torch.nn.Module)]
    elif isinstance(result, (list, tuple)):
        candidates = [v for v in result if isinstance(v, torch.nn.Module)]
    else:
        candidates = []
    if len(candidates) == 1:
        return candidates[0]
    raise LookupError(
        "there is no one model here to take the state dict of: no Accelerator prepared one, "
        f"and what the function returned holds {len(candidates)} modules. Name it: "
        "workers.state_dict('model') (an expression in the ranks' namespace, such as "
        "\"result['model']\")."
    )


def _accelerator() -> Any:
    session = active_session()
    return session.accelerator if session is not None else None


def full_entries(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """The model's state dict entries, unwrapped (no ``module.`` or ``_orig_mod.``), sharded
    ones as they are (``state_export`` puts them together)."""
    accelerator = _accelerator()
    if accelerator is not None and any(model is m for m in accelerator._prepared.models):
        if accelerator.strategy.checkpoint_layout == "deepspeed":
            return list(accelerator.get_state_dict(model).items())
        model = accelerator.unwrap_model(model)
    else:
        while isinstance(inner := getattr(model, "module", None), torch.nn.Module):  # DDP
            model = inner
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    return list(model.state_dict().items())


def map_on_rank(
    fn: Any, dataset: Any, batch_size: int, collate_fn: Any, rank: int, world_size: int
) -> dict[str, Any]:
    """This rank's share of ``map``: its batches' sizes (in its order) and its outputs, on
    the CPU and concatenated (leaf by leaf: tensors and arrays along their first axis, lists
    element by element; tuples and mappings keep their structure)."""
    from torch.utils.data import DataLoader

    batches = rank_batches(len(dataset), batch_size, rank, world_size)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn)
    device = _device_for(fn)
    module = fn if isinstance(fn, torch.nn.Module) else None
    was_training = module.training if module is not None else False
    outputs: list[Any] = []
    try:
        if module is not None:
            module.eval()  # dropout off, batch norm's running statistics: predictions
        with torch.inference_mode():
            for batch in loader:
                outputs.append(_to_host(fn(_to_device(batch, device))))
    finally:
        if module is not None:
            module.train(was_training)
    rows = joined(outputs) if outputs else None
    return {"sizes": [len(b) for b in batches], "rows": rows, "dataset_size": len(dataset)}


def rank_batches(size: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's batches of dataset indices, as a prepared DataLoader shards an unshuffled
    dataset: global batch ``b`` (samples ``b * batch_size`` on) is rank ``b % world``'s, and
    the last round is filled with batches from the start, so that every rank runs as many
    (a sharded model's forward is a collective).

    >>> rank_batches(5, 2, 1, 2)  # global batches [0 1] [2 3] [4] [0 1]: rank 1's
    [[2, 3], [0, 1]]
    """
    starts = range(0, size, batch_size)
    batches = [list(range(s, min(s + batch_size, size))) for s in starts]
    padding = -len(batches) % world_size
    batches += [batches[i % len(batches)] for i in range(padding)] if batches else []
    return batches[rank::world_size]


def _to_device(batch: Any, device: torch.device) -> Any:
    """A batch's tensors on ``device`` (in dicts, lists and tuples; objects with their own
    ``.to``, such as transformers' ``BatchEncoding``, move themselves)."""
    if isinstance(batch, torch.Tensor) or (hasattr(batch, "to") and not isinstance(batch, type)):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _device_for(fn: Any) -> torch.device:
    """Where batches go: the Accelerator's device, a module's own, else this rank's."""
    accelerator = _accelerator()
    if accelerator is not None:
        device: torch.device = accelerator.device
        return device
    if isinstance(fn, torch.nn.Module):
        for parameter in fn.parameters():
            return parameter.device
    session = active_session()
    if session is None or session.config.use_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", session.context.local_rank)


def _to_host(value: Any) -> Any:
    """An output with its tensors on the CPU, out of autograd and inference mode."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()  # a plain tensor: inference tensors cannot travel
    if isinstance(value, Mapping):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_host(item) for item in value)
    return value

"""A prepared model's outputs come back in fp32 exactly as Accelerate's do, now that nbaccel
rebuilds only what holds a half tensor (issue 23, point 4: a raw loop pays for no rebuild).

Accelerate's own ``convert_to_fp32`` is the reference: same types, keys, dtypes and values.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from nbaccel import Accelerator
from nbaccel.accel.strategies.models import to_fp32

accelerate_utils = pytest.importorskip("accelerate.utils")
transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=63,
        eos_token_id=63, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def same(expected: Any, actual: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            same(expected[key], actual[key])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, b in zip(expected, actual, strict=True):
            same(a, b)


def test_a_model_output_is_converted_as_accelerate_converts_it() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def forward() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids, use_cache=False)

    reference = accelerate_utils.convert_to_fp32(forward())
    mine = to_fp32(forward())
    assert mine.logits.dtype == torch.float32 and mine["logits"] is mine.logits
    same(reference, mine)
    assert mine.to_tuple()[1] is mine.logits  # attribute, item and tuple agree


def test_nested_outputs_match_accelerate_and_plain_dicts_are_not_changed() -> None:
    Pair = collections.namedtuple("Pair", "half full")
    half = torch.arange(4, dtype=torch.bfloat16)

    def outputs() -> Any:
        return {
            "pair": Pair(half.clone(), torch.ones(2)),
            "list": [half.clone(), 3, None],
            "ints": torch.arange(3),
            "fp16": (half.to(torch.float16),),
        }

    given = outputs()
    mine = to_fp32(given)
    same(accelerate_utils.convert_to_fp32(outputs()), mine)
    assert given["pair"].half.dtype == torch.bfloat16  # the caller's plain dict: untouched
    untouched = {"a": torch.ones(1), "b": [torch.zeros(1)]}
    assert to_fp32(untouched) is untouched  # nothing half: nothing rebuilt


class ReadOnlyDict(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("read-only")


def test_a_read_only_mapping_is_rebuilt_instead() -> None:
    given = ReadOnlyDict(logits=torch.ones(2, dtype=torch.bfloat16), n=torch.arange(2))
    out = to_fp32(given)
    assert type(out) is ReadOnlyDict and out is not given
    assert out["logits"].dtype == torch.float32 and given["logits"].dtype == torch.bfloat16
    assert out["n"] is given["n"]


def test_prepared_gpt2_trains_to_accelerates_numbers() -> None:
    """Three bf16 AdamW steps of a tiny GPT-2: nbaccel's losses and weights equal
    Accelerate's (in this process, one after the other, from the same weights)."""
    accelerate = pytest.importorskip("accelerate")
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))

    def train(acc: Any) -> tuple[list[float], list[torch.Tensor]]:
        model = tiny_gpt2().train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
        losses = []
        for _ in range(3):
            outputs = model(input_ids=ids, labels=ids)
            # A loss computed outside the model, from the fp32 logits, as well as the model's.
            logits = outputs.logits[:, :-1].flatten(0, 1)
            extra = torch.nn.functional.cross_entropy(logits, ids[:, 1:].flatten())
            acc.backward(outputs.loss + extra)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(outputs.loss.detach()))
        return losses, [p.detach().clone() for p in model.parameters()]

    theirs = train(accelerate.Accelerator(mixed_precision="bf16", cpu=True))
    mine = train(Accelerator(mixed_precision="bf16", cpu=True))
    assert mine[0] == theirs[0]
    assert all(torch.equal(a, b) for a, b in zip(mine[1], theirs[1], strict=True))

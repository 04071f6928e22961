"""log_metrics outside a worker: same record, nothing sent; bad values rejected clearly."""

from __future__ import annotations

import pytest

from nbaccel.metrics import log_metrics


class FakeTensor:
    def item(self) -> float:
        return 0.25


def test_record_shape_and_item_conversion() -> None:
    assert log_metrics({"loss": FakeTensor(), "lr": 1}, step=7) == {
        "loss": 0.25,
        "lr": 1.0,
        "step": 7,
    }


@pytest.mark.parametrize("value", ["0.5", [1.0], None, True])
def test_non_scalars_are_rejected(value: object) -> None:
    with pytest.raises(TypeError, match="log_metrics: 'x' is"):
        log_metrics({"x": value})

"""nbaccel.logging.get_logger in one process; other ranks are simulated with torchrun's
variables (RANK / WORLD_SIZE), which the logger reads when no nbaccel launch or process
group exists. Only rank 0 logging in a real 2-rank run is in tests/multiprocess."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from nbaccel.logging import MultiProcessAdapter, get_logger


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    plain = logging.getLogger("nbaccel-test")
    plain.addHandler(handler)
    plain.setLevel(logging.INFO)
    yield handler
    plain.removeHandler(handler)
    plain.setLevel(logging.NOTSET)


def test_rank_zero_logs_with_the_rank_prefix_and_the_callers_line(records: Records) -> None:
    logger = get_logger("nbaccel-test")
    assert isinstance(logger, MultiProcessAdapter)
    logger.info("loaded %d rows", 3)
    logger.debug("below the level")
    assert records.messages == ["[RANK 0] loaded 3 rows"]
    assert records.records[0].filename == "test_logging.py"
    assert records.records[0].funcName.startswith("test_rank_zero")


def test_other_ranks_log_only_when_asked(records: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    logger = get_logger("nbaccel-test")
    logger.info("main only")
    logger.warning("everywhere", main_process_only=False)
    assert records.messages == ["[RANK 1] everywhere"]
    assert records.records[0].filename == "test_logging.py"


def test_in_order_with_one_process_logs_once(records: Records) -> None:
    get_logger("nbaccel-test").info("in order", in_order=True)
    assert records.messages == ["[RANK 0] in order"]


def test_warning_once_is_emitted_once_from_the_caller(records: Records) -> None:
    logger = get_logger("nbaccel-test")
    for _ in range(3):
        logger.warning_once("careful")
    assert records.messages == ["[RANK 0] careful"]
    assert records.records[0].filename == "test_logging.py"


@pytest.fixture
def restore_root_level() -> Iterator[None]:
    root = logging.getLogger()
    before = root.level
    yield
    root.setLevel(before)
    logging.getLogger("nbaccel-level").setLevel(logging.NOTSET)


def test_log_level_sets_the_logger_and_root_as_accelerate(
    restore_root_level: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    get_logger("nbaccel-level", log_level="debug")
    assert logging.getLogger("nbaccel-level").level == logging.DEBUG
    assert logging.getLogger().level == logging.DEBUG
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "error")
    get_logger("nbaccel-level")
    assert logging.getLogger("nbaccel-level").level == logging.ERROR

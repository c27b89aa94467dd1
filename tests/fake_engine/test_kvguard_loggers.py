"""Every logger of engine_patch (outside its vLLM adapter) and of the fake
engine is under ``kvguard.``, so that configuring
``logging.getLogger("kvguard")`` reaches the engine side as it reaches the
proxy."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import pytest

import engine_patch
import fake_engine


def module_loggers(package: ModuleType, skip: str | None = None) -> dict[str, str]:
    """Module name -> the name of each ``logging.Logger`` a module of
    ``package`` holds at module level (``skip``: a subpackage left out)."""
    found: dict[str, str] = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if skip is not None and info.name.startswith(skip):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, logging.Logger):
                found[f"{info.name}.{name}"] = value.name
    return found


class Collect(logging.Handler):
    """The records a logger's handler receives."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kvguard_handler() -> Iterator[Collect]:
    """A handler on the ``kvguard`` logger, at debug level, and nowhere else."""
    root = logging.getLogger("kvguard")
    handler = Collect()
    level, propagate = root.level, root.propagate
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    root.propagate = False
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        root.propagate = propagate


@pytest.mark.parametrize(
    ("package", "skip", "expected"),
    [
        (engine_patch, "engine_patch.vllm", "engine_patch.scheduler.logger"),
        (fake_engine, None, "fake_engine.engine.logger"),
    ],
    ids=["engine_patch", "fake_engine"],
)
def test_every_logger_is_under_kvguard(
    package: ModuleType, skip: str | None, expected: str, kvguard_handler: Collect
) -> None:
    loggers = module_loggers(package, skip)
    assert expected in loggers
    for where, name in loggers.items():
        assert name.startswith(f"kvguard.{package.__name__}"), where
        logging.getLogger(name).debug("from %s", where)
    assert [r.getMessage() for r in kvguard_handler.records] == [
        f"from {where}" for where in loggers
    ]

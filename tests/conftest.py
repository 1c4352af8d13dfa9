"""Fixtures for every test folder."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _root_logger_as_it_was() -> Iterator[None]:
    """The root logger's handlers and level put back after each test.

    A command run in-process (a Hydra main, ``logging.basicConfig``) gives the root logger a
    handler on the ``sys.stderr`` of that moment, which is pytest's capture of that test;
    every later test's log records then went to a closed file ("Logging error ... I/O
    operation on closed file" in the output, and the record lost).
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)

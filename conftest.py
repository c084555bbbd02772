"""Root pytest configuration (applies to tests/, backends/, platforms/, plugins/).

kvloom configures its ``kvloom`` logger on import (its own handler, no propagation, as
vLLM); pytest's ``caplog`` listens on the root logger, so tests import kvloom with that
configuration off. Tests of the configuration itself run in subprocesses that set
``KVLOOM_CONFIGURE_LOGGING`` themselves; the ``kvloom`` command configures it regardless.
"""

import os

os.environ["KVLOOM_CONFIGURE_LOGGING"] = "0"

import logging  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_kvloom_logger():
    """A test that runs the ``kvloom`` command in-process configures the ``kvloom`` logger
    (no propagation); the next test's ``caplog`` must still see its records."""
    logger = logging.getLogger("kvloom")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:] = saved[0]
    logger.propagate, logger.level = saved[1], saved[2]

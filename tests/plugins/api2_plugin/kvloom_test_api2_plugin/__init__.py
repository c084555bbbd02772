"""A plugin written for kvloom plugin API 2.0: kvloom 1.x must refuse it by name."""

import logging

KVLOOM_PLUGIN_API = "2.0"


def register() -> None:
    logging.getLogger(__name__).info("kvloom-test-api2-plugin registered")

"""A plugin that fails at import time: kvloom must report it loudly, never skip it."""

KVLOOM_PLUGIN_API = "1.0"


def _read_required_setting() -> str:
    raise RuntimeError("kvloom-test-broken-plugin fails on purpose while importing")


SETTING = _read_required_setting()


def register() -> None:
    """What the entry point names; kvloom never gets here because the import fails."""

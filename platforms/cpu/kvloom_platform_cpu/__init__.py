"""kvloom's built-in CPU platform (entry point ``cpu`` in ``kvloom.platform_plugins``)."""

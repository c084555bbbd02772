"""kvloom's built-in CUDA platform (entry point ``cuda`` in ``kvloom.platform_plugins``)."""

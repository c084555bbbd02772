"""kvloom-platform-cpu-threads: an out-of-tree platform (the path a hardware vendor takes)."""

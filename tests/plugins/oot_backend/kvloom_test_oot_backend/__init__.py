"""An out-of-tree attention backend used by kvloom's tests and shown in docs/plugins.md."""

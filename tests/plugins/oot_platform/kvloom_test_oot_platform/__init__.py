"""An out-of-tree platform used by kvloom's tests and shown in docs/plugins.md."""

"""A fork of EXAMPLE_ATTN under the same NAME: installing both must be an error."""

from kvloom_example_attention_backend import ExampleAttentionBackend

KVLOOM_PLUGIN_API = "1.0"


class ForkedExampleBackend(ExampleAttentionBackend):
    supported_head_sizes = (64, 128, 256)

"""A fork of OOT_TEST_ATTN under the same NAME: installing both must be an error."""

from kvloom_test_oot_backend.backend import OotTestAttentionBackend

KVLOOM_PLUGIN_API = "1.0"


class ForkedOotBackend(OotTestAttentionBackend):
    supported_head_sizes = (64, 128, 256)

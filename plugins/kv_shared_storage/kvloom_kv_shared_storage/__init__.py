"""kvloom's shared-storage KV connector, ``ExampleConnector`` (vLLM's example connector,
formerly ``SharedStorageConnector``): engines share KV-cache blocks through a folder."""

from kvloom_kv_shared_storage.connector import ExampleConnector

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["ExampleConnector"]

"""kvloom's CPU-offloading KV connector, ``OffloadingConnector`` (vLLM's native offloading,
``--kv-offloading-size GiB``): blocks evicted from the device kept in (pinned) host memory,
LRU, loaded back asynchronously on a prefix hit; optionally a disk tier below it.

* ``host_index``: the scheduler side's LRU maps of host slots and disk files;
* ``transfers``: the worker side's copies between the device cache and the host buffers;
* ``connector``: ``OffloadingConnector``, the plugin.
"""

from kvloom_kv_offload.connector import OffloadingConnector

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["OffloadingConnector"]

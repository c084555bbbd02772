"""kvloom's P2P KV connector, ``P2pNcclConnector``: disaggregated prefill and decode, one
prefill instance and one decode instance moving KV blocks over a ``torch.distributed``
group of their own (NCCL on GPUs, gloo on the CPU).

* ``params``: the ``kv_transfer_params`` it reads, checked;
* ``link``: the store and process group between the two instances, and the pulls over it;
* ``connector``: ``P2pNcclConnector``, the plugin.
"""

from kvloom_kv_p2p.connector import P2pNcclConnector

KVLOOM_PLUGIN_API = "1.1"

__all__ = ["P2pNcclConnector"]

"""``kvloom router``: the proxy of disaggregated prefill/decode.

Each completion or chat completion is prefilled on a prefill instance (one token, the
connector asked to keep the KV for a remote decode) and decoded on a decode instance that
gets the prefill's ``kv_transfer_params``; the instances' KV connectors move the KV (any
connector: the router only carries ``kv_transfer_params``). ``instances``: the instances
and their health; ``proxy``: how a request is split and forwarded; ``app``: the HTTP
front (``build_app``, ``serve_router``).
"""

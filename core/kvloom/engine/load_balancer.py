"""Data parallelism: which engine core a new request goes to (vLLM's DP load balancing).

With ``--data-parallel-size N`` there are N engine cores (replicas, ``engine_index``
0..N-1). After every step each one sends its load (``EngineLoad``: waiting and running
requests, KV-cache usage) to every front end, with its outputs. A front end sends a new
request to the engine with the lowest score ``4 * waiting + running`` (vLLM's: a waiting
request costs more than a running one), ties going to the one with the least KV cache in
use, then to the lowest index. The requests a front end sent an engine since that
engine's last load count as waiting there, so a burst spreads over the engines instead of
piling onto the one that looked idle.

vLLM gathers the engines' stats in a DP coordinator process, which publishes them to the
front ends every 100 ms. Here every engine core already sends every front end a message
per step (the many-to-many sockets of ``--api-server-count``), and the load rides along:
each front end sees each engine's load as soon as a coordinator could tell it, without
another process, hop or failure mode. What it cannot see, as with vLLM's coordinator, are
requests that other front ends sent since the engine's last step.
"""

from __future__ import annotations

from kvloom.outputs import EngineLoad


class LoadBalancer:
    """Picks the engine core for each new request of one front end."""

    def __init__(self, num_engines: int) -> None:
        self.loads = [EngineLoad(0, 0, 0.0) for _ in range(num_engines)]
        #: Requests this front end sent each engine since its last load.
        self.sent_since_load = [0] * num_engines
        #: Requests this front end sent each engine in all (for tests and debugging).
        self.sent = [0] * num_engines

    def score(self, engine: int) -> tuple[int, float, int]:
        load = self.loads[engine]
        return 4 * (load.num_waiting + self.sent_since_load[engine]) + load.num_running, load.kv_cache_usage, engine

    def choose(self) -> int:
        """The engine for a new request (counted as sent to it)."""
        engine = min(range(len(self.loads)), key=self.score)
        self.sent_since_load[engine] += 1
        self.sent[engine] += 1
        return engine

    def update(self, engine: int, load: EngineLoad) -> None:
        """``engine``'s load after a step (it includes what it had received by then)."""
        self.loads[engine] = load
        self.sent_since_load[engine] = 0

"""Per-step broadcast cost of the ``mp`` executor's calls: per-rank pipes vs the
shared-memory broadcast queue (``kvloom.distributed.shm_broadcast``), no model.

A driver sends ``(seq, "execute_model", (scheduler_output,))`` to ``--ranks`` reader
processes (spawned, as the executor's ranks are) the way ``MultiprocExecutor`` does:

* ``pipes``: pickle once, ``send_bytes`` the same bytes to each rank's pipe, each rank
  ``recv_bytes`` + ``pickle.loads`` (the transport before the queue);
* ``shm``: pickle once, ``enqueue`` into the ring, each rank ``dequeue`` with
  ``pickle.loads`` reading the chunk in place (calls longer than a chunk overflow to the
  pipes; the default 4 MiB chunk holds every step below).

Each rank acknowledges with an empty message on its pipe (as a step's ``None`` reply
does); the driver waits for every acknowledgement. Reported per step: ``send``, the
driver's time until the call is handed over (what the engine core pays before it can go
on: pickling included), and ``round trip``, until every rank has unpickled it and
answered. ``--gap-ms`` makes the driver wait between steps (the ranks' forward pass):
an idle reader of the ring has then backed off from yielding to short sleeps.

Steps: ``decode`` -- ``--num-requests`` running requests, one token each, a new block for
one in 16; ``mixed`` -- the same plus 4 new requests with prompts of ``--prompt-len``
tokens (the step that admits them).

    python benchmarks/bench_shm_broadcast.py [--ranks 2] [--steps 2000] [--gap-ms 0]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import platform
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

from kvloom.distributed.shm_broadcast import BroadcastHandle, ShmBroadcastReader, ShmBroadcastWriter
from kvloom.sampling_params import SamplingParams
from kvloom.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

SPAWN = multiprocessing.get_context("spawn")


def scheduler_output(num_requests: int, new_requests: int, prompt_len: int, step: int) -> SchedulerOutput:
    """A step of ``num_requests`` decoding requests and ``new_requests`` prefills."""
    cached = [
        CachedRequestData(f"req-{i}", ([1000 + i] if (i + step) % 16 == 0 else [],), 128 + step)
        for i in range(num_requests)
    ]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    new = [
        NewRequestData(
            f"new-{step}-{j}",
            [(7 * k + j) % 32000 for k in range(prompt_len)],
            [],
            params,
            None,
            (list(range(j * 1000, j * 1000 + prompt_len // 16 + 1)),),
            0,
            eos_token_id=2,
        )
        for j in range(new_requests)
    ]
    tokens = {r.req_id: 1 for r in cached} | {r.req_id: prompt_len for r in new}
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        finished_req_ids={f"done-{step}"},
    )


def _rank(mode: str, rank: int, conn: Connection, handle: BroadcastHandle | None) -> None:
    queue = ShmBroadcastReader(handle, rank, overflow=conn) if handle is not None else None
    while True:
        if queue is not None:
            _seq, method, _ = queue.dequeue(decode=pickle.loads)
        else:
            _seq, method, _ = pickle.loads(conn.recv_bytes())
        if method == "stop":
            break
        conn.send_bytes(b"")
    if queue is not None:
        queue.close()


def run(mode: str, ranks: int, outputs: list[SchedulerOutput], steps: int, gap_s: float) -> dict[str, Any]:
    pipes = [SPAWN.Pipe() for _ in range(ranks)]
    writer = ShmBroadcastWriter(ranks, overflow=[p[0] for p in pipes]) if mode == "shm" else None
    handle = writer.handle if writer is not None else None
    procs = [SPAWN.Process(target=_rank, args=(mode, r, pipes[r][1], handle), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    conns = [p[0] for p in pipes]

    def send(call: tuple[Any, ...]) -> None:
        payload = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        if writer is not None:
            writer.enqueue(payload)
        else:
            for c in conns:
                c.send_bytes(payload)

    send_s, trip_s = [], []
    warmup = min(100, steps // 10)
    for i in range(warmup + steps):
        if gap_s:
            time.sleep(gap_s)
        out = outputs[i % len(outputs)]
        t0 = time.perf_counter()
        send((i, "execute_model", (out,)))
        t1 = time.perf_counter()
        for c in conns:
            c.recv_bytes()
        t2 = time.perf_counter()
        if i >= warmup:
            send_s.append(t1 - t0)
            trip_s.append(t2 - t0)
    send((-1, "stop", ()))
    for p in procs:
        p.join(timeout=30)
    if writer is not None:
        writer.close()

    def stats(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"median {statistics.median(xs) * 1e6:7.1f} us, p90 {xs[int(0.9 * len(xs))] * 1e6:7.1f} us"

    return {"send": stats(send_s), "round trip": stats(trip_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--new-requests", type=int, default=4, help="prefills in the mixed step")
    args = parser.parse_args()
    print(f"{platform.node()} {platform.processor() or platform.machine()} cpus={os.cpu_count()} "
          f"python {platform.python_version()} ranks={args.ranks} steps={args.steps} gap={args.gap_ms} ms")  # fmt: skip
    for kind, new in (("decode", 0), ("mixed", args.new_requests)):
        outputs = [scheduler_output(args.num_requests, new, args.prompt_len, s) for s in range(16)]
        size = len(pickle.dumps((0, "execute_model", (outputs[0],)), protocol=pickle.HIGHEST_PROTOCOL))
        pickling = []
        for i in range(200):
            t0 = time.perf_counter()
            pickle.dumps((i, "execute_model", (outputs[i % 16],)), protocol=pickle.HIGHEST_PROTOCOL)
            pickling.append(time.perf_counter() - t0)
        print(f"{kind:6s} {size / 1024:7.1f} KiB pickle alone: median {statistics.median(pickling) * 1e6:7.1f} us")
        for mode in ("pipes", "shm"):
            result = run(mode, args.ranks, outputs, args.steps, args.gap_ms / 1000)
            print(
                f"{kind:6s} {size / 1024:7.1f} KiB {mode:5s}  send {result['send']}   round trip {result['round trip']}"
            )


if __name__ == "__main__":
    main()

"""The fetch plan of ``kvsp.cost.plan_fetch`` for a whole fleet, compiled.

Placing a long prompt walks every block for every instance (2,048 blocks x 100 instances is
some 200,000 greedy decisions), and each decision depends on the ones before it, so neither a
Python loop nor numpy across instances gets it below tens of milliseconds. These loops are the
reference's, statement for statement, compiled by numba: the same floating-point operations in
the same order (no fast-math), the same tie-breaking (the lower holder URL, as columns are
sorted by URL). tests/core/test_pricing.py holds the results equal to the reference.

numba is imported on the first plan (``_jit_kernels``), not with this module: it loads its
compiler and the socket module, which a user of the core has no need of until it prices a
fleet.

The inputs are arrays, ``kvsp.pricing.BlockTable`` and ``kvsp.pricing.LinkTable`` build them:

- ``shape_of[b, h]``: the replica shape of block b at holder column h, -1 when h has none.
- ``shape_size[s]``, ``shape_layers[s, e]`` and ``shape_read[s, e]``: octets of shape s and its
  residency entries' layer counts (0 past its last entry) and read rates (0.0 when the entry has
  none).
- ``rate[i, h]``, ``rtt[i, h]``, ``usable[i, h]``: instance i's link to holder column h.
- ``own_column[i]``: the column of instance i's own URL (its replicas make a block resident),
  -1 when it holds none of the blocks.
"""

from __future__ import annotations

import threading

import numpy as np


def _transfer_us(s, link_mbit_per_s, shape_size, shape_layers, shape_read):
    # kvsp.cost.replica_transfer_us: each layer range at min(link, tier read rate).
    layers = 0
    for e in range(shape_layers.shape[1]):
        layers += shape_layers[s, e]
    total = 0.0
    for e in range(shape_layers.shape[1]):
        count = shape_layers[s, e]
        if count == 0:
            break
        rate = link_mbit_per_s
        read = shape_read[s, e]
        if read > 0.0 and read < rate:
            rate = read
        total += 8 * (shape_size[s] * count / layers) / rate
    return total


def _walk(i, shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column, ranked):
    """Instance i's loadable prefix and fetch_us; with ``ranked`` of one row per block, also
    each fetched block's usable sources by finish time (-1 after the last; a resident block's
    row stays all -1)."""
    blocks, holders = shape_of.shape
    record = ranked.shape[0] > 0
    busy = np.zeros(holders)
    used = np.zeros(holders, dtype=np.bool_)
    finish = np.empty(holders)
    # A fleet has few replica shapes: each shape's transfer time over each link, once.
    transfer = np.empty((shape_size.shape[0], holders))
    for h in range(holders):
        if usable[i, h]:
            for s in range(shape_size.shape[0]):
                transfer[s, h] = _transfer_us(s, rate[i, h], shape_size, shape_layers, shape_read)
    own = own_column[i]
    loadable = 0
    for b in range(blocks):
        if own >= 0 and shape_of[b, own] >= 0:
            loadable += 1
            continue
        best = -1
        best_finish = 0.0
        best_cost = 0.0
        options = 0
        for h in range(holders):
            s = shape_of[b, h]
            if s < 0 or not usable[i, h]:
                finish[h] = np.inf
                continue
            cost = transfer[s, h]
            finish[h] = rtt[i, h] + busy[h] + cost
            options += 1
            if best < 0 or finish[h] < best_finish:
                best, best_finish, best_cost = h, finish[h], cost
        if best < 0:
            break
        busy[best] = busy[best] + best_cost
        used[best] = True
        loadable += 1
        if record:
            # Insertion by (finish, column): the reference sorts its options the same way.
            for position in range(options):
                pick = -1
                for h in range(holders):
                    if shape_of[b, h] < 0 or not usable[i, h]:
                        continue
                    taken = False
                    for earlier in range(position):
                        if ranked[b, earlier] == h:
                            taken = True
                            break
                    if taken:
                        continue
                    if pick < 0 or finish[h] < finish[pick]:
                        pick = h
                ranked[b, position] = pick
    fetch_us = -np.inf
    for h in range(holders):
        if used[h]:
            source_us = rtt[i, h] + busy[h]
            if source_us > fetch_us:
                fetch_us = source_us
    if fetch_us == -np.inf:
        fetch_us = 0.0
    return loadable, fetch_us


def _plan_fleet(shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column):
    """Loadable prefix length and fetch_us of every instance."""
    count = rate.shape[0]
    loadable = np.zeros(count, dtype=np.int64)
    fetch_us = np.zeros(count)
    nothing = np.empty((0, shape_of.shape[1]), dtype=np.int32)
    for i in range(count):
        loadable[i], fetch_us[i] = _walk(
            i,
            shape_of,
            shape_size,
            shape_layers,
            shape_read,
            rate,
            rtt,
            usable,
            own_column,
            nothing,
        )
    return loadable, fetch_us


def _plan_sources(i, shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column):
    """Instance i's sources per block, by finish time: (loadable, ranked columns per block)."""
    ranked = np.full(shape_of.shape, -1, dtype=np.int32)
    loadable, _ = _walk(
        i, shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column, ranked
    )
    return loadable, ranked


# The loops above, callees first: numba resolves a callee among the module's globals as it
# compiles its caller, so each is made a dispatcher before the next.
_KERNELS = ("_transfer_us", "_walk", "_plan_fleet", "_plan_sources")
_compile_lock = threading.Lock()
_jitted = False


def _jit_kernels() -> None:
    """Make the loops numba dispatchers (once; each compiles, or loads from the disk cache, on
    its first call)."""
    global _jitted
    if _jitted:
        return
    with _compile_lock:
        if _jitted:
            return
        from numba import njit

        module = globals()
        for name in _KERNELS:
            module[name] = njit(cache=True)(module[name])
        _jitted = True


def plan_fleet(shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column):
    """Loadable prefix length and fetch_us of every instance."""
    _jit_kernels()
    return _plan_fleet(
        shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column
    )


def plan_sources(i, shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column):
    """Instance i's sources per block, by finish time: (loadable, ranked columns per block)."""
    _jit_kernels()
    return _plan_sources(
        i, shape_of, shape_size, shape_layers, shape_read, rate, rtt, usable, own_column
    )


def warm_in_background() -> None:
    """Compile the loops (seconds; then cached on disk and loaded in a fraction of one) as a
    serving process starts rather than on its first placement or failover. Call it only in a
    process that will not fork: a fork while the compiler's lock is held would leave the child
    waiting on it for ever."""
    threading.Thread(target=warm, name="kvsp-fetchplan", daemon=True).start()


def warm() -> None:
    """Compile (or load from the cache) both entry points with a plan of one block."""
    arrays = (
        np.zeros((1, 1), dtype=np.int32),
        np.ones(1, dtype=np.int64),
        np.ones((1, 1), dtype=np.int64),
        np.zeros((1, 1)),
        np.ones((1, 1)),
        np.zeros((1, 1)),
        np.ones((1, 1), dtype=bool),
        np.full(1, -1, dtype=np.int64),
    )
    plan_fleet(*arrays)
    plan_sources(0, *arrays)

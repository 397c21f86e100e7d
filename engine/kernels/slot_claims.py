"""The expert store's bookkeeping for a token whose experts all sit in RAM slots, compiled.

Why: in a warm chat nearly every token finds its experts resident. Holding their
slots (`ExpertStore.acquire`: each slot's use count up, its LRU stamp renewed, the
hit counted) and letting them go again was some fifty numpy element reads and
writes from Python per layer, 30-40 us of every layer's decode on the machines of
docs/benchmarks.md. These two functions take the same steps, in the same order;
`moe_step.resident_experts_step` calls them around the experts' launches, under
the store's lock.
"""

from __future__ import annotations

from numba import njit


@njit(nogil=True, cache=True)
def claim_resident(slot_of, loading, pf_pass, busy, last, experts, clock, slots, stock, shadow):
    """Hold the slots of `experts` if every one of them is ready in a slot.

    Ready: a distinct expert id >= 0 whose slot has finished loading and holds no PILOT
    read still waiting for its first use (that hit is counted by the store's ledger, in
    Python). Then, in the order given, each slot's use count goes up by one and its LRU
    stamp is the next tick of `clock`, as `ExpertStore._take` does for a hit; the slots
    are written into `slots` and the new clock returned. Otherwise nothing changes and
    the result is -1.

    `stock` (the router's stock top-K; may be empty) gets its shadow counts in `shadow`:
    [0] the experts a RAM slot holds or loads (the chosen ones among them), [1] the others,
    as `expert_store.count_shadow` counts them without a GPU tier.
    """
    n = experts.shape[0]
    for i in range(n):
        e = experts[i]
        if e < 0 or e >= slot_of.shape[0]:
            return -1
        s = slot_of[e]
        if s < 0 or loading[s] or pf_pass[s] >= 0:
            return -1
        for j in range(i):
            if experts[j] == e:
                return -1
        slots[i] = s
    for i in range(n):
        s = slots[i]
        busy[s] += 1
        clock += 1
        last[s] = clock
    shadow[0] = 0
    shadow[1] = 0
    for i in range(stock.shape[0]):
        e = stock[i]
        if e >= 0:
            if e < slot_of.shape[0] and slot_of[e] >= 0:
                shadow[0] += 1
            else:
                shadow[1] += 1
    return clock


@njit(nogil=True, cache=True)
def release_slots(busy, slots):
    """Give back one use of each slot in `slots` (never below zero, as `ExpertStore.release`)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        if busy[s] > 0:
            busy[s] -= 1

"""The event-loop side of the preprocessing pool's shared-memory slots (:class:`encgraph.serving.slots.FreeSlots`):
requests that find every slot taken wait in arrival order, a slot given back goes to the first of them (the giver
cannot take it again ahead of them), a cancelled waiter passes its turn on, and waiters woken after the arena was
replaced or closed look again."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from encgraph.serving.slots import Arena, FreeSlots, attach, read, write


@pytest.fixture
def arena():
    a = Arena(2, 64)
    yield a
    a.close()


def test_slots_are_shared_between_mappings(arena):
    other = attach(arena.path)
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert write(other, 1, arena.size, data) and not write(other, 0, arena.size, np.zeros(100, np.float32))
    assert np.array_equal(arena.read(1, (3, 4), "<f4"), data)
    assert np.array_equal(read(other, 1, arena.size, (3, 4), "<f4"), data)


def test_waiters_get_slots_in_turn_and_the_giver_cannot_take_it_back(arena):
    """Two slots, six tasks that each take a slot, yield, give it back and take again, until 120 takes in all:
    every task got its share along the way (a giver that took its slot back at once would keep the two slots
    between two tasks while the four others starved)."""
    free = FreeSlots(lambda: arena)
    counts: collections.Counter = collections.Counter()

    async def client(name: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            a, slot = await free.take()
            assert a is arena and slot in (0, 1)
            counts[name] += 1
            if sum(counts.values()) >= 120:
                stop.set()
            await asyncio.sleep(0)
            free.give(a, slot)

    async def main() -> None:
        stop = asyncio.Event()
        await asyncio.wait_for(asyncio.gather(*(client(i, stop) for i in range(6))), 10)

    asyncio.run(main())
    assert sum(counts.values()) >= 120 and all(counts[i] >= 18 for i in range(6)), counts
    assert sorted(arena.take() for _ in range(2)) == [0, 1]  # all given back


def test_order_cancellation_and_a_closed_arena(arena):
    free = FreeSlots(lambda: arena)
    order: list[str] = []

    async def wants(name: str) -> tuple:
        got = await free.take()
        order.append(name)
        return got

    async def main() -> None:
        held = [await free.take(), await free.take()]  # both slots taken
        tasks = {n: asyncio.ensure_future(wants(n)) for n in "abc"}
        await asyncio.sleep(0)  # a, b, c wait, in that order
        tasks["b"].cancel()
        free.give(*held[0])  # to a
        free.give(*held[1])  # to c: b was cancelled
        a, c = await tasks["a"], await tasks["c"]
        assert order == ["a", "c"] and {a[1], c[1]} == {0, 1}
        assert tasks["b"].cancelled()
        # Every slot taken again, a waiter, then the arena closes: woken, it finds no arena (the pipe's case).
        waiting = asyncio.ensure_future(free.take())
        await asyncio.sleep(0)
        arena.close()
        free.wake(every=True)
        assert await asyncio.wait_for(waiting, 5) == (None, None)

    asyncio.run(main())

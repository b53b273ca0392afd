"""eprt.comm.links in one process: three ranks' Links on threads, their start-up all-gather done
with a barrier (the transport's is MPI's)."""

import threading
import time

from eprt.comm.links import Links


def three_ranks(on_lost):
    """Links of ranks 0, 1 and 2, made concurrently as the transport makes them on every rank."""
    size, texts, barrier = 3, [None] * 3, threading.Barrier(3)

    def exchange_for(rank):
        def exchange(text):
            barrier.wait()
            texts[rank] = text
            barrier.wait()
            return list(texts)

        return exchange

    made = [None] * size

    def make(rank):
        made[rank] = Links(rank, size, exchange_for(rank), on_lost(rank))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return made


def test_rank0_says_goodbye_on_every_link_though_a_worker_says_its_own_first(monkeypatch):
    """Rank 0 closes its links; worker 1, told to stop, says its own goodbye before rank 0 has said
    goodbye to worker 2. Worker 2 must see a goodbye, not a death (the watcher used to stop on
    seeing rank 0's ``_closing`` when woken by worker 1's goodbye, closing worker 2's link before
    rank 0 wrote to it: 2 false deaths in 600 start/stop cycles at mpiexec -n 3)."""
    lost = []
    zero, one, two = three_ranks(lambda rank: lambda peer: lost.append((rank, peer)))
    link_to_two = next(sock for sock, peer in zero._links.items() if peer == 2)
    first = []
    real_send = type(link_to_two).send

    class Delayed(type(link_to_two)):
        __slots__ = ()  # (the layout of socket.socket, so that the link can take this class)

        def send(self, data, *args):
            if self is link_to_two and not first:  # before the goodbye to worker 2: worker 1 leaves
                first.append(True)
                one.close()
                time.sleep(0.3)  # rank 0's watcher sees worker 1's goodbye meanwhile
            return real_send(self, data, *args)

    link_to_two.__class__ = Delayed
    order = sorted(zero._links.items(), key=lambda item: item[1] != 2)  # worker 2's link first
    monkeypatch.setattr(zero, "_links", dict(order))
    zero.close()
    time.sleep(0.3)
    two.close()
    assert first and lost == [] and zero.lost == one.lost == two.lost == []


def test_a_peer_that_closes_without_a_goodbye_is_lost():
    lost = []
    zero, one, two = three_ranks(lambda rank: lambda peer: lost.append((rank, peer)))
    for sock in list(two._links):
        sock.close()  # what the kernel does for a killed process
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost == [(0, 2)] and zero.lost == [2]
    for links in (zero, one, two):
        links.close()

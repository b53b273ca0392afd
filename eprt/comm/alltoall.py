"""The all-to-all MoE exchange (``--moe-exchange alltoall``; docs/design.md, "All-to-all MoE
exchange"): a row goes only to the ranks that hold its routed experts and its partial sums come
back to the row's owner, so a rank's bytes per layer grow with top-k, not with the number of ranks.

N rows in the pass (global order), n of them owned here, k choices, D hidden, P ranks, U units:
a unit is one (row, rank) pair, a row's share of work on a rank holding one of its experts (with
EPLB, ``per_choice``: one (row, choice) pair, the choice's replica chosen on every rank alike).

Owners: under dp attention the rows' owners of the pass (``DpExchange``); under replicated
attention every rank holds every row, so the rows are split by position (rank r owns the r-th
contiguous share), the dispatch sends nothing (the rank computing a unit already holds its row)
and the owners all-gather their summed shares at the end.

The sum keeps today's bits: a rank computes a unit's partial over its local choices exactly as
the all-gather exchange computes that row (same rows per expert group, in the same order), and
the owner adds the P ranks' partials in rank order, zeros where a rank held none of the row's
experts (the all-gather's partial there is +0.0), which is the all-gather's arithmetic; under
EPLB the owner adds a row's k choice rows in choice order, as ``ExpertSlots.moe`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class AllToAllExchange:
    """``run`` once per MoE layer; ``dp``: the pass's DpExchange under dp attention (the rows'
    owners), None under replicated attention. ``device``: GPU ranks' NCCL combine
    (eprt.comm.device_combine.DeviceCombine): the rows and partials stay on the device and move by
    NCCL send/recv (``device.alltoall_rows``); None: through the host (``Transport.alltoall_rows``).
    Either way the routing (who sends which rows where, and the counts) is worked out on the host."""

    def __init__(self, transport, xp=np, dp=None, device=None):
        self.transport, self.xp, self.dp, self.device = transport, xp, dp, device
        self.wxp = np if device is None else xp  # where the exchanged rows and partials live

    def run(self, x, weights: np.ndarray, ids: np.ndarray, dest: np.ndarray, compute: Callable, per_choice: bool):
        """The routed MoE output of this rank's rows (dp: [n, D]; replicated: every row's, [N, D]).
        ``x``: this rank's rows (dp) or every row (replicated); ``weights``/``ids`` [N, k] on the
        host, every row's (ids: what ``compute`` takes, EPLB's slots included); ``dest`` [N, k] the rank
        computing each choice; ``compute(x [m, D], weights [m, c], ids [m, c])`` -> float32 [m, D]."""
        P, me, N, k = self.transport.size, self.transport.rank, ids.shape[0], ids.shape[1]
        owner = self._owners(N)  # [N]
        row, choice, rank = _units(dest, P, per_choice)  # [U] each, in (row, choice) order
        mine = np.flatnonzero(rank == me)  # the units computed here, in row order
        by_owner = mine[np.argsort(owner[row[mine]], kind="stable")]  # received grouped by owner
        xs = self._dispatch(x, owner, row, rank, mine, by_owner)  # [m, D] in row order
        if per_choice:
            w, i = weights[row[mine], choice[mine]][:, None], ids[row[mine], choice[mine]][:, None]  # [m, 1]
        else:
            w, i = weights[row[mine]], ids[row[mine]]  # [m, k]
        if len(mine):
            partial = self._wire(compute(xs, self.xp.asarray(w), self.xp.asarray(i))).astype(np.float32, copy=False)
        else:
            partial = self.wxp.zeros((0, x.shape[1]), np.float32)
        sent = partial[self._at(np.argsort(owner[row[mine]], kind="stable"))]  # row order -> grouped by owner
        owned = np.flatnonzero(owner[row] == me)
        owned = owned[np.argsort(rank[owned], kind="stable")]  # this rank's units, grouped by computing rank
        counts_back = np.bincount(owner[row[by_owner]], minlength=P).tolist()
        got = self._alltoall(sent, counts_back, np.bincount(rank[owned], minlength=P).tolist())
        local = np.cumsum(owner == me) - 1  # [N] a row's place among this rank's rows
        out = self._fold(got, local[row[owned]], choice[owned], rank[owned], int((owner == me).sum()), k, per_choice)
        if self.dp is None and P > 1:  # replicated attention: every rank needs every row
            gather = self.transport.allgather_rows if self.device is None else self.device.gather_rows
            out = gather(out, np.bincount(owner, minlength=P).tolist())
        return self._device(out)

    def _dispatch(self, x, owner: np.ndarray, row: np.ndarray, rank: np.ndarray, mine: np.ndarray, by_owner):
        """The rows of the units computed here, in row order: sent by their owners (dp attention),
        or taken from ``x`` itself (replicated attention: every rank holds every row)."""
        if self.dp is None:
            return x[self.xp.asarray(row[mine])] if len(mine) else x[:0]
        P, me = self.transport.size, self.transport.rank
        local = np.cumsum(owner == me) - 1
        out_units = np.flatnonzero(owner[row] == me)
        out_units = out_units[np.argsort(rank[out_units], kind="stable")]  # grouped by destination, row order
        rows = self._wire(x)
        send = rows[self._at(local[row[out_units]])] if len(out_units) else rows[:0]
        send_counts = np.bincount(rank[out_units], minlength=P).tolist()
        got = self._alltoall(send, send_counts, np.bincount(owner[row[by_owner]], minlength=P).tolist())
        xs = self.wxp.empty_like(got)
        if len(got):
            xs[self._at(np.argsort(owner[row[mine]], kind="stable"))] = got  # grouped by owner -> row order
        return self._device(xs)

    def _fold(self, got, where, choice, rank, n: int, k: int, per_choice: bool) -> np.ndarray:
        """This rank's rows [n, D] from the partials ``got`` [u, D] of its units (row ``where``, from
        ``rank``): EPLB, a row's k choice rows added in choice order; else the ranks' partials added
        in rank order, zeros for the ranks that held none of the row's experts."""
        D, xp = got.shape[1], self.wxp
        if per_choice:
            every = xp.zeros((n, k, D), np.float32)
            if len(where):
                every[self._at(where), self._at(choice)] = got
            out = every[:, 0]
            for j in range(1, k):
                out = out + every[:, j]
            return xp.ascontiguousarray(out)
        out, start = None, np.concatenate([[0], np.cumsum(np.bincount(rank, minlength=self.transport.size))])
        for r in range(self.transport.size):  # rank order: the all-gather's parts[0] + parts[1] + ...
            part = xp.zeros((n, D), np.float32)
            if start[r + 1] > start[r]:
                part[self._at(where[start[r] : start[r + 1]])] = got[start[r] : start[r + 1]]
            if out is None:
                out = part
            else:
                out += part  # in place: np.add(out, part, out=out)
        return out

    def _owners(self, N: int) -> np.ndarray:
        """[N] each row's owner: dp attention's, or replicated attention's split by position."""
        P = self.transport.size
        if self.dp is not None:
            counts = np.asarray(self.dp.counts)
            rank_major = np.repeat(np.arange(P), counts)
            return rank_major if self.dp._inverse is None else rank_major[self.dp._inverse]
        return (np.arange(N) * P) // max(N, 1)

    def _alltoall(self, rows, send: list[int], recv: list[int]):
        """The variable all-to-all of ``rows`` (on the wire's side: the device or the host)."""
        if self.device is None:
            return self.transport.alltoall_rows(rows, send, recv)
        return self.device.alltoall_rows(rows, send, recv)

    def _wire(self, a):
        """``a`` where the exchange moves it: the device (NCCL) or the host."""
        if self.wxp is np:
            return a if isinstance(a, np.ndarray) else self.xp.asnumpy(a)
        return self.wxp.asarray(a)

    def _at(self, index: np.ndarray):
        """A host index array for the wire's arrays."""
        return index if self.wxp is np else self.wxp.asarray(index)

    def _device(self, a):
        return a if self.xp is np else self.xp.asarray(a)


def _units(dest: np.ndarray, P: int, per_choice: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, choice, rank) of every unit, in (row, choice) order: per_choice, one unit per
    (row, choice); else one per (row, rank) with any of the row's choices (choice: its first)."""
    N, k = dest.shape
    if per_choice:
        return np.repeat(np.arange(N), k), np.tile(np.arange(k), N), dest.reshape(-1).astype(np.int64)
    hit = np.zeros((N, P), bool)
    hit[np.repeat(np.arange(N), k), dest.reshape(-1)] = True
    row, rank = np.nonzero(hit)  # row-major: each row's ranks ascending
    return row, np.zeros(len(row), np.int64), rank

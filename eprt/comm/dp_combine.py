"""dp attention's MoE exchange (docs/design.md, "dp attention"): in each forward pass every rank's
tokens and their routing (each owner routes its own) are all-gathered in the batch's global row
order, each rank applies its experts to all of them, and the partial sums go back to the rows'
owners, summed in rank order (the bits of the replicated combine). N rows in the pass, D hidden.
"""

from __future__ import annotations

import numpy as np


class DpExchange:
    """``begin(owners)`` once per forward pass, then ``gather_routed`` / ``scatter`` once per MoE layer
    (``routing`` alone for the all-to-all exchange, eprt/comm/alltoall.py)."""

    def __init__(self, transport, xp=np):
        self.transport, self.xp = transport, xp
        self.counts: list[int] = [0] * transport.size  # rows of this pass on each rank
        self._order: np.ndarray | None = None  # rank-major row j is global row _order[j]; None: the same order
        self._inverse: np.ndarray | None = None  # global row i is rank-major row _inverse[i]

    @property
    def local_rows(self) -> int:
        return self.counts[self.transport.rank]

    def begin(self, owners: np.ndarray) -> None:
        """``owners``: [N] the owner rank of each row of this pass, rows in the batch's global order."""
        owners = np.asarray(owners, dtype=np.int64)
        if len(owners) and (owners.min() < 0 or owners.max() >= self.transport.size):
            raise ValueError(f"row owners {owners.tolist()} outside the ranks [0, {self.transport.size})")
        self.counts = np.bincount(owners, minlength=self.transport.size).tolist()
        if np.all(owners[1:] >= owners[:-1]):
            self._order = self._inverse = None
        else:
            self._order = np.argsort(owners, kind="stable")
            self._inverse = np.argsort(self._order)

    def routing(self, weights, ids) -> tuple[np.ndarray, np.ndarray]:
        """Every row's routing in global order on the host, from each owner's rows: weights [n, k]
        float32 and ids [n, k] here -> [N, k] each (one all-gather of 2k words a row)."""
        both = self.transport.allgather_rows(_routing_words(self._host(weights), self._host(ids)), self.counts)
        return _split_routing(both if self._inverse is None else both[self._inverse])

    def gather_routed(self, x, weights, ids):
        """``gather`` and ``routing`` in one all-gather: x [n, D] with its routing [n, k] -> every rank's
        rows [N, D] (on x's device) and their weights and ids [N, k] (host), in global order."""
        host = np.ascontiguousarray(self._host(x))
        n, width = host.shape[0], host.shape[1] * host.itemsize
        words = _routing_words(self._host(weights), self._host(ids))  # [n, 2k] int32
        packed = np.concatenate(
            [host.view(np.uint8).reshape(n, width), words.view(np.uint8).reshape(n, 4 * words.shape[1])], axis=1
        )  # [n, width + 8k] bytes
        every = self.transport.allgather_rows(packed, self.counts)  # [N, width + 8k] bytes, rank-major
        every = every if self._inverse is None else every[self._inverse]
        rows = np.ascontiguousarray(every[:, :width]).view(host.dtype)  # [N, D]
        weights, ids = _split_routing(np.ascontiguousarray(every[:, width:]).view(np.int32))
        return self._device(rows), weights, ids

    def scatter(self, partial):
        """partial [N, D] float32 in global order -> [local rows, D]: this rank's rows summed over ranks."""
        host = self._host(partial)
        mine = self.transport.scatter_sum_rows(host if self._order is None else host[self._order], self.counts)
        return self._device(mine)

    def mine(self, full):
        """full [N, D] in global order, the same on every rank (EPLB's combine) -> this rank's rows."""
        lo = sum(self.counts[: self.transport.rank])
        if self._order is None:
            return full[lo : lo + self.local_rows]
        return full[self._device(self._order[lo : lo + self.local_rows])]

    def collect(self, rows: np.ndarray, counts: list[int] | None = None) -> np.ndarray | None:
        """The pass's output rows [local rows, W] of every rank on rank 0, in global order (one
        small gather); None on the other ranks. ``counts``: rows per rank when not the pass's
        (a prefill chunk returns only its last row), which are then in rank order."""
        gathered = self.transport.gather_rows(rows, self.counts if counts is None else counts)  # [N, W] rank-major
        if gathered is None or counts is not None or self._inverse is None:
            return gathered
        return gathered[self._inverse]

    def _host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else self.xp.asnumpy(a)

    def _device(self, a: np.ndarray):
        return a if self.xp is np else self.xp.asarray(a)


def _routing_words(weights: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[n, 2k] int32: each row's k float32 weights (their bits), then its k expert ids."""
    w, i = weights.astype(np.float32, copy=False), ids.astype(np.int32, copy=False)
    return np.ascontiguousarray(np.concatenate([w.view(np.int32), i], axis=1))


def _split_routing(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, 2k] int32 -> (weights [N, k] float32, ids [N, k] int32)."""
    k = words.shape[1] // 2
    return np.ascontiguousarray(words[:, :k]).view(np.float32), np.ascontiguousarray(words[:, k:])

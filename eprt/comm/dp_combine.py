"""dp attention's MoE exchange (docs/design.md, "dp attention"): in each forward pass every rank's
tokens are all-gathered in the batch's global row order, each rank applies its experts to all of
them, and the partial sums go back to the rows' owners, summed in rank order (the bits of the
replicated combine). N rows in the pass, D hidden.
"""

from __future__ import annotations

import numpy as np


class DpExchange:
    """``begin(owners)`` once per forward pass, then ``gather`` / ``scatter`` once per MoE layer."""

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

    def gather(self, x):
        """x [local rows, D] -> [N, D]: every rank's rows, in global order."""
        rows = self.transport.allgather_rows(self._host(x), self.counts)  # [N, D] rank-major
        return self._device(rows if self._inverse is None else rows[self._inverse])

    def routing(self, weights, ids) -> tuple[np.ndarray, np.ndarray]:
        """Every row's routing in global order on the host, from each owner's rows: weights [n, k]
        float32 and ids [n, k] here -> [N, k] each (one all-gather of 2k words a row)."""
        w = self._host(weights).astype(np.float32, copy=False)
        i = self._host(ids).astype(np.int32, copy=False)
        k = w.shape[1]
        both = self.transport.allgather_rows(np.concatenate([w.view(np.int32), i], axis=1), self.counts)
        both = both if self._inverse is None else both[self._inverse]  # [N, 2k] in global order
        return np.ascontiguousarray(both[:, :k]).view(np.float32), np.ascontiguousarray(both[:, k:])

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

"""``--overlap``: while a decode step's forward pass runs, rank 0 does the host work that does not
need its logits: the step's sampling plan (``RowSampler.plan``) and the next step's
DECODE_BATCH, encoded for the same slots with placeholder tokens. The frames, their order and the
scheduler's calls are those without it (docs/design.md, "Overlap").

On the CPU backend the pass runs on one helper thread (NumPy lets go of the GIL inside BLAS), its
MoE combines included: MPI is called from that thread only while the main thread plans or waits,
never from both at once. A step without rows for the host sampler has too little to plan to pay
for the hand-off, and runs inline. On a GPU the launches return at once, so the pass runs inline
and the wait is the readback of the sampled tokens; but where its MoE combines go through the host
(``blocks_host``: ranks that share a GPU, or no NCCL) the host waits in every layer, and the pass
runs on the helper thread as on the CPU. The helper thread computes on the rank's device
(``Ops.bind_thread``: CUDA's current device is per thread, and a new one starts on GPU 0).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

from eprt.comm.protocol import DecodeBatch, DecodeBatchWords


class DecodeOverlap:
    def __init__(self, executor, transport):
        self.executor, self.transport = executor, transport
        combine = getattr(getattr(executor, "model", None), "combine", None)
        # the pass returns once launched: a GPU whose combines do not wait on the host
        self.launched = executor.ops.name != "cpu" and not getattr(combine, "blocks_host", False)
        self.threaded = not self.launched and transport.any_thread
        self._pool = None
        if self.threaded:
            bind = executor.ops.bind_thread  # the rank's device on the helper thread
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="eprt-forward", initializer=bind)
        self._running = None  # the running step: its Future (threaded) or its logits
        self._plan: tuple | None = None  # (rows, the sampling plan of those rows)
        self._next: DecodeBatchWords | None = None  # the next step's frame, encoded ahead for these slots

    def decode(self, frames, item, slots: tuple, tokens: tuple, rows: list, sampling_plan, thread: bool) -> None:
        """Send the step's DECODE_BATCH (through ``frames``, for the plan's ``item``), launch its forward
        pass (on the helper thread when ``thread`` and there is one), and while it runs make
        ``sampling_plan(rows)`` and encode the next step's frame for the same slots."""
        ahead, self._next = self._next, None
        cmd = DecodeBatch(tuple(slots), tuple(tokens))
        if ahead is not None and ahead.slots == tuple(slots):
            frames.send_words(item, cmd, ahead.fill(tokens))
        else:
            frames.send(item, cmd)
        frames.flush()
        slots, tokens = list(slots), list(tokens)
        inputs = self.executor.decode_inputs(slots, tokens)
        thread = thread and self._pool is not None
        if thread:
            self._running = self._pool.submit(self.executor.decode_forward, inputs)
        else:
            self._running = self.executor.decode_forward(inputs)
        try:
            self._plan = (rows, sampling_plan(rows))
            if thread or self.launched:  # (a pass that has ended hides nothing: the next step encodes as usual)
                self._next = DecodeBatchWords(tuple(slots))
        except BaseException:
            self._settle()  # the pass (and its combines) ends before the error goes up
            raise

    def plan_of(self, rows: list, row: int, n: int) -> tuple | None:
        """The sampling plan made during the pass of ``rows`` when rows [row, row + n) are all of
        them (None otherwise: the caller makes it now); taken once."""
        plan, self._plan = self._plan, None
        if plan is None or plan[0] is not rows or row != 0 or n != len(rows):
            return None
        return plan[1]

    def logits(self):
        """The running step's logits [B, V], once its pass has ended (its error, if it failed)."""
        running = self._running
        try:
            return running.result() if isinstance(running, Future) else running
        except BaseException:
            self._settle()  # an interrupt while waiting: the pass ends first
            raise
        finally:
            self._running = None

    def _settle(self) -> None:
        """Wait, without raising, until the running pass (if on the helper thread) has ended."""
        if isinstance(self._running, Future):
            wait([self._running])
        self._running = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

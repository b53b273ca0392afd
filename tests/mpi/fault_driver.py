"""A small job over the real transport and worker loop, for tests/mpi/test_faults.py.

    mpiexec -n 3 python tests/mpi/fault_driver.py MODE

Rank 0 plays the runner: one prefill, then decode steps, each followed by a toy forward
pass (LAYERS MoE combines); the workers run ``run_worker`` on an executor that does the
same combines. MODE picks the fault, injected at decode step FAIL_STEP:
    clean       no fault: SHUTDOWN, every rank exits 0
    raise       rank 1's executor raises
    kill        rank 1 kills itself with SIGKILL
    stall       rank 1 hangs without dying (only the watchdog can end the job)
    root-raise  rank 0 raises between steps while the workers wait for a command
    idle        rank 0 idles longer than the collective timeout between steps (no fault)
"""

import os
import signal
import sys
import time

import numpy as np

from eprt.comm.logging import setup_logging
from eprt.comm.protocol import DecodeBatch, Prefill
from eprt.comm.worker import run_worker
from eprt.comm.world import open_transport

D, LAYERS, MAX_SLOTS, STEPS, FAIL_STEP = 8, 2, 4, 6, 3
MODES = ("clean", "raise", "kill", "stall", "root-raise", "idle")


def forward(transport, n_tokens):
    """The network traffic of a forward pass: one combine per MoE layer."""
    for layer in range(LAYERS):
        transport.allsum(np.full((n_tokens, D), transport.rank + layer, np.float32))  # [T, D]


class ToyExecutor:
    hidden_size = D

    def __init__(self, transport, mode):
        self.transport, self.mode, self.step = transport, mode, 0

    def prefill(self, slot, tokens, chunk_start, chunk_len, vision_rows):
        forward(self.transport, chunk_len)

    def decode(self, slots, tokens):
        self.step += 1
        if self.transport.rank == 1 and self.step == FAIL_STEP:
            if self.mode == "raise":
                raise RuntimeError(f"injected failure at decode step {self.step}")
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "stall":
                time.sleep(3600)
        forward(self.transport, len(slots))

    def compact(self, slot, new_slot):
        pass

    def release(self, slot):
        pass

    def shutdown(self):
        pass


def run_root(transport, mode) -> int:
    transport.send(Prefill(0, 0, 4, (1, 2, 3, 4)))
    transport.flush()
    forward(transport, 4)
    for step in range(1, STEPS + 1):
        if mode == "root-raise" and step == FAIL_STEP:
            raise RuntimeError("injected failure on rank 0")
        if mode == "idle" and step == FAIL_STEP:
            time.sleep(1.5 * transport.timeout)
        transport.send(DecodeBatch((0,), (10 + step,)))
        transport.flush()
        forward(transport, 1)
    transport.shutdown()
    return 0


def main(mode: str) -> int:
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    with open_transport() as transport:
        setup_logging(transport.rank)
        transport.dump_dir = os.environ.get("EPRT_DUMP_DIR")  # the flight recorder, as the engine sets it
        if transport.rank == 0:
            return run_root(transport, mode)
        return run_worker(transport, ToyExecutor(transport, mode), MAX_SLOTS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

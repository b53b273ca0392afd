"""A real-model job for the engine fault tests (tests/mpi/test_engine_faults.py).

    mpiexec -n 2 python engine_fault_driver.py CHECKPOINT_DIR raise|kill|loadfail|mixedcompute|identityfail|kvfail|clean

Rank 1's decode is wrapped to fail at its 4th step: ``raise`` raises an exception,
``kill`` SIGKILLs the process (as the OOM killer would). ``loadfail``: rank 1 is given a
checkpoint directory that does not exist (a model missing on one node). ``mixedcompute``:
rank 1 reports another NumPy/BLAS build; ``identityfail``: computing it fails on rank 1.
``kvfail``: rank 1 has no room for its KV pool. ``record``: a clean run recording payloads
(``--record-payloads``) under $EPRT_DUMP_DIR; ``corrupt``: the same, with rank 1's 5th MoE
partial silently perturbed (what ``eprt replay`` must find). A third argument ``dp`` runs the
job with ``--attention dp``, ``overlap`` with ``--overlap on``. ``drift`` (with ``--check-state``):
rank 1's mirror drifts from rank 0's, as a one-line bug would make it: under dp its copy of another
owner's pool grows one token late, replicated its prefix cache keeps nothing; ``checked``: a clean
run with ``--check-state``.
"""

import os
import signal
import sys

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor


def inject(mode: str) -> None:
    real = ShardExecutor.decode
    steps = {"n": 0}

    def failing(self, slots, tokens, *counts):
        steps["n"] += 1
        if steps["n"] == 4:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure in decode step 4")
        return real(self, slots, tokens, *counts)

    ShardExecutor.decode = failing


def plant_drift(dp: bool) -> None:
    if dp:
        from eprt.engine.sequences import Sequences

        def late(self, states, slots, appended):
            for st, slot, new in zip(states, slots, appended):
                self.blocks_of(slot).grow(st.key, st.length + len(new) - 1)
                st.tokens.extend(new)

        Sequences.mirror = late
    else:
        from eprt.engine.sequences import Sequences

        Sequences.cache = lambda self, slot, upto=None: None


def main() -> int:
    path, mode = sys.argv[1], sys.argv[2]
    if mode in ("raise", "kill") and os.environ.get("PMI_RANK") == "1":
        inject(mode)
    if mode == "loadfail" and os.environ.get("PMI_RANK") == "1":
        path += "-missing-on-this-node"
    if mode == "mixedcompute" and os.environ.get("PMI_RANK") == "1":  # another NumPy/BLAS build
        from eprt.engine import startup

        startup.compute_identity = lambda ops: ("cpu: NumPy 0.0, BLAS other", "node2:cpu")
    if mode == "identityfail" and os.environ.get("PMI_RANK") == "1":  # the identity itself fails
        from eprt.engine import startup

        def broken(ops):
            raise RuntimeError("cannot read the device properties (injected)")

        startup.compute_identity = broken
    if mode == "kvfail" and os.environ.get("PMI_RANK") == "1":  # no room after the weights
        from eprt.engine import startup

        def no_room(*args):
            raise RuntimeError("no room for a KV pool (injected)")

        startup._kv_blocks = no_room
    if mode == "corrupt" and os.environ.get("PMI_RANK") == "1":
        from eprt.engine import startup

        real_combine, calls = startup._combine, {"n": 0}

        def corrupting(transport, ops):
            combine, gather_rows = real_combine(transport, ops)

            def perturbed(partial):
                calls["n"] += 1
                return combine(partial + 1e-3 if calls["n"] == 5 else partial)

            return perturbed, gather_rows

        startup._combine = corrupting
    if mode == "drift" and os.environ.get("PMI_RANK") == "1":
        plant_drift("dp" in sys.argv[3:])
    cfg = EngineConfig(
        model=path,
        device="cpu",
        max_batch=4,
        block_size=4,
        max_model_len=64,
        record_payloads=mode in ("record", "corrupt"),
        dump_dir=os.environ.get("EPRT_DUMP_DIR", "eprt-dumps"),
        attention="dp" if "dp" in sys.argv[3:] else "replicated",  # (not auto: these faults are planted per mode)
        overlap="overlap" in sys.argv[3:],
        check_state=mode in ("drift", "checked"),
    )
    with launch_engine(cfg) as engine:
        params = [SamplingParams(max_tokens=10) for i in range(3)]
        if cfg.overlap:  # sampled rows: rank 0's passes run on its helper thread
            params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=i) for i in range(3)]
        results = engine.generate([GenerationRequest([1, 2, 3, i], p) for i, p in enumerate(params)])
        print("generated", [len(r.token_ids) for r in results], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

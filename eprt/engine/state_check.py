"""``--check-state``: every rank hashes the state it mirrors after a step and the ranks compare the
hashes in one small all-gather; a difference ends the job naming the structure, the ranks and the
step (docs/design.md, "State digests"). The digests are kept in the flight recorder.
"""

from __future__ import annotations

import hashlib

import numpy as np

from eprt.api import JobFailure
from eprt.comm.transport import ranks_text


class StateDrift(JobFailure):
    """The ranks' mirrors of one structure differ: the job cannot go on."""


def _feed(h, x) -> None:
    """Hash ``x`` (arrays, bytes, tuples and lists of them, plain values) into ``h`` unambiguously."""
    if isinstance(x, np.ndarray):
        h.update(b"a%s%s:" % (x.dtype.str.encode(), repr(x.shape).encode()))
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, (tuple, list)):
        h.update(b"(%d" % len(x))
        for item in x:
            _feed(h, item)
        h.update(b")")
    elif isinstance(x, bytes):
        h.update(b"b%d:" % len(x))
        h.update(x)
    else:
        text = repr(x).encode()
        h.update(b"r%d:" % len(text))
        h.update(text)


def digest(state) -> int:
    """A 64-bit hash of ``state``."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, state)
    return int.from_bytes(h.digest(), "little")


def mirrored_states(executor) -> dict[str, object]:
    """Every structure this rank mirrors, by name: the slots, the KV accounting (each owner's pool
    under dp attention, with the owner of each slot), the prefix cache, the EPLB placement and the
    recurrent-state snapshots; the same names on every rank of a job."""
    out: dict[str, object] = {"slots": executor.slots.mirrored_state()}
    pools = getattr(executor, "pools", None)
    managers = (
        {"": executor.blocks} if pools is None else {f" of rank {r}'s pool": p for r, p in enumerate(pools.pools)}
    )
    for suffix, manager in managers.items():
        for name, state in manager.mirrored_state().items():
            out[name + suffix] = state
    if pools is not None:
        out["owners"] = executor.owners
    experts = executor.model.slots
    if experts is not None:
        out["placement"] = (experts.epoch, experts.placement.table)
    if executor.snapshots is not None:
        out["snapshots"] = executor.snapshots.mirrored_state()
    return out


def state_digests(executor) -> dict[str, int]:
    return {name: digest(state) for name, state in sorted(mirrored_states(executor).items())}


def drift_message(step: int, names: list[str], table: np.ndarray) -> str | None:
    """None when every rank's row of ``table`` [P, K] (one digest per name) agrees; else what differs."""
    differing = [k for k in range(table.shape[1]) if (table[:, k] != table[0, k]).any()]
    if not differing:
        return None
    parts = []
    for k in differing:
        groups: dict[int, list[int]] = {}
        for rank, value in enumerate(table[:, k].tolist()):
            groups.setdefault(value, []).append(rank)
        held = "; ".join(f"{ranks_text(ranks)} {value:016x}" for value, ranks in groups.items())
        parts.append(f"{names[k]} ({held})")
    return f"the ranks' mirrored state differs after step {step}: " + ", ".join(parts)


def check_state(executor, transport, step: int) -> None:
    """Rank 0 after sending CHECK_STATE, a worker on receiving it: compare this step's digests with
    every rank's; raises StateDrift on every rank when they differ."""
    mine = state_digests(executor)
    names = list(mine)
    table = transport.allgather_words(np.asarray(list(mine.values()), np.uint64), names)  # [P, K]
    message = drift_message(step, names, table)
    if message is not None:
        transport.dump_frames(message)
        raise StateDrift(message)

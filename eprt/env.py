"""The one registry of environment variables eprt reads (all prefixed ``EPRT_``).

Every knob that is not a command-line flag lives here, with its type, default and
meaning, so ``eprt env`` (and this file) is the complete list. Values are read when
asked for, never at import time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


def launcher_int(names: tuple, what: str, minimum: int, environ=None) -> tuple[str, int] | None:
    """(name, value) of the first of the MPI launcher's variables ``names`` that is set (these
    are the launchers' own, not eprt settings), None when none is; ValueError naming it when its
    value is not an integer >= ``minimum``."""
    environ = os.environ if environ is None else environ
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                number = int(value)
            except ValueError:
                number = minimum - 1
            if number < minimum:
                raise ValueError(f"launcher variable {name}={value!r} is not {what} (an integer >= {minimum})")
            return name, number
    return None


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: object
    parse: Callable[[str], object]
    help: str

    def get(self):
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None

    def raw(self) -> str | None:
        """The value as set, "" included (None: unset), for a setting where set-but-empty is an error."""
        return os.environ.get(self.name)


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected a boolean (1/0, true/false, yes/no, on/off)")


REGISTRY: dict[str, EnvVar] = {}


def _register(name: str, default, parse, help: str) -> EnvVar:
    var = EnvVar(name, default, parse, help)
    REGISTRY[name] = var
    return var


DEVICE = _register("EPRT_DEVICE", "", str, "default backend when --device is not given: cpu or cuda")
LOG_LEVEL = _register("EPRT_LOG_LEVEL", "INFO", str, "logging level (DEBUG, INFO, WARNING, ERROR)")
LOG_ALL_RANKS = _register("EPRT_LOG_ALL_RANKS", False, _bool, "log from every rank, not only rank 0")
COLLECTIVE_TIMEOUT = _register(
    "EPRT_COLLECTIVE_TIMEOUT", 30.0, float, "seconds a rank waits in one collective before the watchdog aborts the job"
)
CHECK_STATE = _register(
    "EPRT_CHECK_STATE",
    False,
    _bool,
    "compare every rank's digests of its mirrored state after each step (--check-state; off by default)",
)
BLOCK_SIZE = _register("EPRT_BLOCK_SIZE", 16, int, "tokens per KV block")
NUM_BLOCKS = _register("EPRT_NUM_BLOCKS", 0, int, "KV blocks per rank on the CPU backend (0: sized from max context)")
COMBINE = _register(
    "EPRT_COMBINE",
    "auto",
    str,
    "the GPU MoE combine: nccl (on the device), host (pinned host memory), auto (nccl if usable)",
)
DUMP_DIR = _register(
    "EPRT_DUMP_DIR",
    "eprt-dumps",
    str,
    "where each rank writes its flight recorder on a failure, SIGUSR2 or --dump-frames",
)
API_KEY = _register("EPRT_API_KEY", "", str, "API key eprt serve requires (Bearer) when --api-key is not given")
CPU_EXPERTS = _register(
    "EPRT_CPU_EXPERTS",
    "auto",
    str,
    "small CPU expert groups: numba (compiled kernel, the cpu extra), numpy (GEMV per row), auto (numba if found)",
)
KERNEL_DIR = _register(
    "EPRT_KERNEL_DIR", "", str, "directory of the .cu kernel sources (default: the checkout's or the wheel's kernels/)"
)


def _progress(s: str) -> str:
    v = s.strip().lower()
    if v not in ("auto", "bar", "lines", "off"):
        raise ValueError("expected auto, bar, lines or off")
    return v


PROGRESS = _register(
    "EPRT_PROGRESS",
    "auto",
    _progress,
    "eprt run / generate progress on stderr: bar (redrawn in place), lines (a line every 5 s), off; "
    "auto: bar on a terminal, else lines (mpiexec's ranks write to a pipe: EPRT_PROGRESS=bar for the bar)",
)
SUPERVISOR = _register(
    "EPRT_SUPERVISOR",
    True,
    _bool,
    "under a multi-rank launcher, run each rank under a supervisor process that keeps a kill -9 of one rank "
    "from taking the others down before they report it (docs/launch.md)",
)


def describe() -> str:
    lines = []
    for v in REGISTRY.values():
        lines.append(f"{v.name:28s} default={v.default!r:8s} {v.help}")
    return "\n".join(lines)

"""tests/checkpoints.py's ``building``: a checkpoint is built once by one of several processes
(pytest-xdist workers, MPI ranks, test phases run at once), and a reader never sees half of one."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
from checkpoints import building


def _build(path: str, log: str, seen: str) -> None:
    """Build ``path`` slowly (a file at a time, config.json last), appending to ``log`` when this
    process builds; then record what this process found there."""
    with building(path, path + "-merged") as temp:
        if temp is not None:
            with open(log, "a") as f:
                f.write(f"{os.getpid()}\n")
            for out in temp:
                for name in ("model.safetensors", "generation_config.json", "config.json"):
                    time.sleep(0.05)
                    with open(os.path.join(out, name), "w") as f:
                        f.write(name)
    with open(seen, "a") as f:
        f.write(",".join(sorted(os.listdir(path))) + ";" + ",".join(sorted(os.listdir(path + "-merged"))) + "\n")


def test_concurrent_builders_build_once_and_every_one_finds_it_whole(tmp_path):
    path, log, seen = str(tmp_path / "ckpt" / "model"), str(tmp_path / "log"), str(tmp_path / "seen")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build, args=(path, log, seen)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(open(log).read().split()) == 1  # one process built it
    whole = "config.json,generation_config.json,model.safetensors"
    assert open(seen).read().split() == [f"{whole};{whole}"] * 4
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model", "model-merged"]  # no lock or temporary left


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    path = str(tmp_path / "model")
    with pytest.raises(RuntimeError, match="planted"), building(path) as temp:
        open(os.path.join(temp[0], "config.json"), "w").close()
        raise RuntimeError("planted")
    assert [e for e in os.listdir(tmp_path) if not e.endswith(".lock")] == []
    with building(path) as temp:
        open(os.path.join(temp[0], "config.json"), "w").close()
    with building(path) as temp:
        assert temp is None  # built: nothing to do
    assert os.listdir(path) == ["config.json"]


def test_an_existing_folder_without_the_checkpoint_is_filled(tmp_path):
    # tmp_path_factory.mktemp and a benchmark's --dir hand over a folder that exists, maybe not empty
    (tmp_path / "notes.txt").write_text("kept")
    with building(str(tmp_path)) as temp:
        for name in ("model.safetensors", "config.json"):
            open(os.path.join(temp[0], name), "w").close()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "notes.txt"]

"""The real engine under mpiexec: a failing worker ends the job non-zero with its error
printed by rank 0; a killed worker ends it non-zero within 60 s. Launched once from a
plain pytest (skipped inside a larger MPI world)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import build_checkpoint

from eprt.comm.world import launcher_world_size

DRIVER = Path(__file__).with_name("engine_fault_driver.py")

pytestmark = [
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH"),
    pytest.mark.skipif(launcher_world_size() > 1, reason="launches its own jobs; run once, not per rank"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint("olmoe", str(tmp_path_factory.mktemp("fault") / "olmoe"))


def launch(ckpt, mode, dump_dir=None, attention=None, overlap=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["EPRT_COLLECTIVE_TIMEOUT"] = "20"
    if dump_dir is not None:
        env["EPRT_DUMP_DIR"] = str(dump_dir)
    start = time.monotonic()
    p = subprocess.run(
        ["mpiexec", "-n", "2", sys.executable, str(DRIVER), ckpt, mode]
        + ([attention] if attention else [])
        + (["overlap"] if overlap else []),
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


def test_clean_job_exits_zero(ckpt):
    code, out, _ = launch(ckpt, "clean")
    assert code == 0, out
    assert "generated [10, 10, 10]" in out


def test_worker_exception_mid_generation_is_reported_by_rank_0(ckpt):
    code, out, took = launch(ckpt, "raise")
    assert code != 0
    assert "eprt: rank 1 failed: RuntimeError: injected failure in decode step 4" in out
    assert "generated" not in out
    assert took < 60


def test_dp_attention_worker_exception_is_reported_by_rank_0(ckpt):
    """Under dp attention rank 1 fails inside its own rows' decode: rank 0, waiting in the MoE
    exchange, names it and the job ends non-zero."""
    code, out, took = launch(ckpt, "raise", attention="dp")
    assert code != 0
    assert "eprt: rank 1 failed: RuntimeError: injected failure in decode step 4" in out
    assert "generated" not in out
    assert took < 60


def test_dp_attention_killed_worker_ends_the_job_within_60s(ckpt):
    code, out, took = launch(ckpt, "kill", attention="dp")
    assert code != 0
    assert took < 60


def test_dp_attention_clean_job_exits_zero(ckpt):
    code, out, _ = launch(ckpt, "clean", attention="dp")
    assert code == 0, out
    assert "generated [10, 10, 10]" in out


@pytest.mark.parametrize("mode", ["clean", "raise", "kill"])
def test_overlap_keeps_the_failure_rules(ckpt, mode):
    """--overlap on: rank 0 waits in its combines on the helper thread when rank 1 fails; the job
    ends as without the overlap."""
    code, out, took = launch(ckpt, mode, overlap=True)
    if mode == "clean":
        assert code == 0 and "generated [10, 10, 10]" in out, out
        return
    assert code != 0 and "generated" not in out
    if mode == "raise":
        assert "eprt: rank 1 failed: RuntimeError: injected failure in decode step 4" in out
    assert took < 60


def test_killed_worker_ends_the_job_within_60s(ckpt):
    code, out, took = launch(ckpt, "kill")
    assert code != 0
    assert took < 60


def test_a_rank_that_cannot_load_ends_the_job_named(ckpt):
    code, out, took = launch(ckpt, "loadfail")
    assert code != 0
    assert "rank 1 could not start: ConfigError" in out and "-missing-on-this-node" in out
    assert took < 60


def test_ranks_that_compute_differently_are_refused_named(ckpt):
    code, out, took = launch(ckpt, "mixedcompute")
    assert code != 0
    assert "rank 1 could not start: it computes with 'cpu: NumPy 0.0, BLAS other', rank 0 with 'cpu: NumPy" in out
    assert "generated" not in out and took < 60


def test_a_rank_without_room_for_its_kv_pool_ends_the_job_named(ckpt):
    code, out, took = launch(ckpt, "kvfail")
    assert code != 0
    assert "rank 1 could not start: RuntimeError: no room for a KV pool (injected)" in out
    assert "generated" not in out and took < 60


def test_a_rank_failing_to_describe_its_compute_ends_the_job_named(ckpt):
    code, out, took = launch(ckpt, "identityfail")
    assert code != 0
    assert "rank 1 could not start: RuntimeError: cannot read the device properties (injected)" in out
    assert "generated" not in out and took < 60


def replay(dump_dir, ckpt, rank):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    cmd = [sys.executable, "-m", "eprt", "replay", str(dump_dir), "--model", ckpt, "--rank", str(rank)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_replay_matches_a_clean_recording(ckpt, tmp_path):
    code, out, _ = launch(ckpt, "record", tmp_path)
    assert code == 0, out
    for rank in (0, 1):
        rc, said = replay(tmp_path, ckpt, rank)
        assert rc == 0 and "outputs and slot state match the recording" in said, said


def test_replay_finds_the_first_divergent_combine_of_a_corrupted_worker(ckpt, tmp_path):
    code, out, _ = launch(ckpt, "corrupt", tmp_path)
    assert code == 0 and "generated [10, 10, 10]" in out, out  # a silent corruption: the job ends "fine"
    entries = [json.loads(line) for line in (tmp_path / "payloads" / "rank-1.jsonl").read_text().splitlines()]
    fifth = [e for e in entries if e["kind"] == "combine"][4]
    rc, said = replay(tmp_path, ckpt, 1)
    assert rc == 1, said
    assert f"diverged at entry {fifth['i']} (collective #{fifth['collective']}): this rank's MoE partial" in said, said
    rc, said = replay(tmp_path, ckpt, 0)  # rank 0 computed right from what it received
    assert rc == 0, said


@pytest.mark.parametrize("attention", [None, "dp"])
def test_a_mirror_that_drifts_ends_the_job_naming_the_structure_and_the_step(ckpt, tmp_path, attention):
    code, out, took = launch(ckpt, "drift", dump_dir=tmp_path, attention=attention)
    assert code != 0 and "generated" not in out, out
    structure = "blocks of rank 0's pool" if attention else "prefix cache"
    assert "the ranks' mirrored state differs after step" in out and f"{structure} (rank 0 " in out, out
    assert "; rank 1 " in out
    recorded = [json.loads(line) for line in (tmp_path / "frames-rank-0.jsonl").read_text().splitlines()[1:]]
    digests = [e for e in recorded if e["kind"] == "words"]
    assert digests and structure in digests[-1]["labels"], digests[-1:]  # the flight recorder keeps them
    assert took < 60


@pytest.mark.parametrize("attention", [None, "dp"])
def test_checked_state_agrees_on_a_clean_job(ckpt, attention):
    code, out, _ = launch(ckpt, "checked", attention=attention)
    assert code == 0 and "generated [10, 10, 10]" in out, out

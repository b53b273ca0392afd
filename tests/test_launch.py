"""The launchers in launch/ and the hostfiles in hostfiles/.

eprt-mpirun is run against a fake mpiexec (first on PATH, or named by $MPIEXEC) that
prints a chosen --version and echoes its arguments one per line, so every test sees
the exact command for each MPI flavour and hostfile format. The SLURM scripts run with
fake srun/scontrol the same way. The last tests use the real MPICH here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
HOSTFILES = ROOT / "hostfiles"
MPIRUN = LAUNCH / "eprt-mpirun"
SHELL_SCRIPTS = [LAUNCH / "eprt-mpirun", LAUNCH / "eprt.sbatch", LAUNCH / "interactive.sh"]

VERSIONS = {
    "openmpi": "mpirun (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/",
    "hydra": "HYDRA build details:\n    Version:                                 4.2.0",
    "intel": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619",
}
ECHO_ARGS = '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n'


def fake_tools(tmp_path: Path, version: str) -> Path:
    """A bin/ with mpiexec (its --version is ``version``), srun and scontrol that echo their args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "mpiexec").write_text(
        f'#!/bin/sh\nif [ "$1" = "--version" ]; then cat <<\'EOF\'\n{version}\nEOF\nexit 0; fi\n'
        + ECHO_ARGS.split("\n", 1)[1]
    )
    (bin_dir / "srun").write_text(ECHO_ARGS)
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "gpu-a01\\ngpu-a02\\n"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def run(cmd: list, bin_dir: Path | None = None, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EPRT_", "SLURM_", "MPIEXEC"))}
    if bin_dir is not None:
        base["PATH"] = f"{bin_dir}:{base['PATH']}"
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env={**base, **env}, cwd=ROOT, timeout=60
    )


def dry_run(tmp_path, flavour: str, *args, **env) -> list:
    bin_dir = fake_tools(tmp_path, VERSIONS[flavour])
    proc = run([MPIRUN, "--dry-run", *args], bin_dir, **env)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[0] == str(bin_dir / "mpiexec")
    return words[1:]


def without_env_forwarding(words: list) -> list:
    """The command minus Open MPI's ``-x NAME`` pairs."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w == "-x":
            skip = True
        else:
            out.append(w)
    return out


CASES = [
    # (flavour, hostfile, extra options, expected mpiexec arguments before "eprt")
    ("openmpi", "localhost.openmpi", [], ["-n", "2", "--hostfile", "hostfiles/localhost.openmpi"]),
    ("openmpi", "localhost.hydra", [], ["-n", "2", "--host", "localhost:2"]),
    ("hydra", "localhost.hydra", [], ["-n", "2", "-f", "hostfiles/localhost.hydra"]),
    ("hydra", "localhost.openmpi", [], ["-n", "2", "-hosts", "localhost:2"]),
    (
        "intel",
        "two-nodes.hydra",
        ["--ranks-per-node", "4"],
        ["-n", "8", "-f", "hostfiles/two-nodes.hydra", "-ppn", "4"],
    ),
    (
        "openmpi",
        "two-nodes.hydra",
        ["--ranks-per-node", "4"],
        ["-n", "8", "--host", "node001:8,node002:8", "--map-by", "ppr:4:node"],
    ),
    ("openmpi", "two-nodes.openmpi", ["-n", "3"], ["-n", "3", "--hostfile", "hostfiles/two-nodes.openmpi"]),
    ("hydra", "two-nodes.openmpi", [], ["-n", "16", "-hosts", "node001:8,node002:8"]),
]


@pytest.mark.parametrize(
    "flavour,hostfile,extra,expected",
    CASES,
    ids=[f"{c[0]}-{c[1]}{'-' + '-'.join(c[2]) if c[2] else ''}" for c in CASES],
)
def test_dry_run_command_per_mpi_and_hostfile_format(tmp_path, flavour, hostfile, extra, expected):
    words = dry_run(
        tmp_path, flavour, "--hostfile", f"hostfiles/{hostfile}", *extra, "serve", "--model", "/models/my moe"
    )
    assert without_env_forwarding(words) == expected + ["eprt", "serve", "--model", "/models/my moe"]
    assert ("-x" in words) == (flavour == "openmpi")


def test_open_mpi_gets_the_environment_forwarded(tmp_path):
    words = dry_run(tmp_path, "openmpi", "-n", "2", "env", EPRT_LOG_LEVEL="DEBUG", CUDA_VISIBLE_DEVICES="2,3")
    forwarded = {words[i + 1] for i, w in enumerate(words) if w == "-x"}
    assert {"PATH", "EPRT_LOG_LEVEL", "CUDA_VISIBLE_DEVICES"} <= forwarded
    assert not any(name.startswith("SLURM_") or name == "HOME" for name in forwarded)


def test_mpiexec_options_pass_through_before_the_separator(tmp_path):
    words = dry_run(tmp_path, "hydra", "-n", "4", "-genv", "FOO", "bar", "--", "generate", "--prompt", "a -n b")
    assert words == ["-n", "4", "-genv", "FOO", "bar", "eprt", "generate", "--prompt", "a -n b"]


def test_mpiexec_named_by_environment_and_exec(tmp_path):
    bin_dir = fake_tools(tmp_path, VERSIONS["hydra"])
    renamed = tmp_path / "my-mpiexec"
    (bin_dir / "mpiexec").rename(renamed)
    proc = run(
        [MPIRUN, "-n", "2", "--ranks-per-node", "1", "run", "--input", "my prompts.jsonl"],
        bin_dir,
        MPIEXEC=str(renamed),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["-n", "2", "-ppn", "1", "eprt", "run", "--input", "my prompts.jsonl"]


@pytest.mark.parametrize(
    "args,hostfile_text,message",
    [
        (["serve"], None, "give -n/--np"),
        (["-n", "0", "serve"], None, "-n must be a positive integer"),
        (["-n", "2"], None, "no eprt command"),
        (["-n", "2", "--bind-to", "none", "serve"], None, "unknown option '--bind-to'"),
        (["--mpi", "lam", "-n", "2", "serve"], None, "--mpi must be openmpi or hydra"),
        (["--hostfile", "HF", "serve"], "a slots=2\nb:2\n", "mixes Open MPI lines"),
        (["--hostfile", "HF", "serve"], "a slots=two\n", "slot count must be a positive integer"),
        (["--hostfile", "HF", "serve"], "a cpus=2\n", "HF:1: cannot read 'cpus=2'"),
        (["--hostfile", "HF", "serve"], "a\nb\n", "give -n/--np"),
        (["--hostfile", "HF", "serve"], "# nobody\n", "names no host"),
        (["--hostfile", "missing-file", "serve"], None, "cannot read hostfile"),
    ],
)
def test_clear_errors(tmp_path, args, hostfile_text, message):
    if hostfile_text is not None:
        (tmp_path / "HF").write_text(hostfile_text)
        args = [str(tmp_path / "HF") if a == "HF" else a for a in args]
        message = message.replace("HF", str(tmp_path / "HF"))
    proc = run([MPIRUN, "--dry-run", *args], fake_tools(tmp_path, VERSIONS["openmpi"]))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_unknown_mpi_asks_for_the_flavour(tmp_path):
    proc = run([MPIRUN, "--dry-run", "-n", "2", "serve"], fake_tools(tmp_path, "SomeMPI 1.0"))
    assert proc.returncode == 2
    assert "cannot tell which MPI" in proc.stderr and "SomeMPI 1.0" in proc.stderr and "--mpi" in proc.stderr
    proc = run([MPIRUN, "--dry-run", "--mpi", "hydra", "-n", "2", "serve"], fake_tools(tmp_path, "SomeMPI 1.0"))
    assert proc.returncode == 0 and "eprt serve" in proc.stdout


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse_and_are_executable(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_sbatch_template(tmp_path):
    text = (LAUNCH / "eprt.sbatch").read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives and all(" # " in line and line.split(" # ", 1)[1].strip() for line in directives), (
        "every #SBATCH line needs a comment"
    )
    options = dict((line.split()[1].lstrip("-") + "=").split("=")[:2] for line in directives)
    assert options["ntasks-per-node"] == options["gpus-per-node"]  # one rank per GPU
    outside = run(["bash", LAUNCH / "eprt.sbatch", "serve"])
    assert outside.returncode == 2 and "not inside a SLURM allocation" in outside.stderr
    bin_dir = fake_tools(tmp_path, VERSIONS["openmpi"])
    inside = run(
        ["bash", LAUNCH / "eprt.sbatch", "serve", "--model", "/m", "--host", "0.0.0.0"],
        bin_dir,
        SLURM_JOB_ID="42",
        SLURM_NNODES="2",
        SLURM_NTASKS="16",
        SLURM_JOB_NODELIST="gpu-a[01-02]",
    )
    assert inside.returncode == 0, inside.stderr
    srun_args = inside.stdout.splitlines()[2:]
    assert srun_args == ["--mpi=pmix", "--kill-on-bad-exit=1", "eprt", "serve", "--model", "/m", "--host", "0.0.0.0"]
    no_command = run(["bash", LAUNCH / "eprt.sbatch"], bin_dir, SLURM_JOB_ID="42")
    assert no_command.returncode == 2 and "no eprt command" in no_command.stderr


def test_interactive_script(tmp_path):
    outside = run([LAUNCH / "interactive.sh", "serve"])
    assert outside.returncode == 2 and "salloc" in outside.stderr
    bin_dir = fake_tools(tmp_path, VERSIONS["hydra"])
    slurm = dict(
        SLURM_JOB_ID="7",
        SLURM_NTASKS="16",
        SLURM_NNODES="2",
        SLURM_NTASKS_PER_NODE="8",
        SLURM_JOB_NODELIST="gpu-a[01-02]",
    )
    with_srun = run([LAUNCH / "interactive.sh", "serve", "--port", "9000"], bin_dir, **slurm)
    assert with_srun.returncode == 0, with_srun.stderr
    assert with_srun.stdout.splitlines() == [
        "--mpi=pmix",
        "--ntasks=16",
        "--kill-on-bad-exit=1",
        "eprt",
        "serve",
        "--port",
        "9000",
    ]
    assert "rank 0 on gpu-a01" in with_srun.stderr
    with_mpirun = run([LAUNCH / "interactive.sh", "--mpirun", "serve"], bin_dir, **slurm)
    assert with_mpirun.returncode == 0, with_mpirun.stderr
    assert with_mpirun.stdout.splitlines() == ["-n", "16", "-ppn", "8", "eprt", "serve"]


def _real_hydra() -> bool:
    mpiexec = shutil.which("mpiexec")
    return mpiexec is not None and "HYDRA" in run([mpiexec, "--version"]).stdout


@pytest.mark.skipif(not _real_hydra(), reason="needs MPICH's Hydra mpiexec")
def test_localhost_hydra_hostfile_with_real_mpiexec():
    proc = run(
        [
            "mpiexec",
            "-f",
            HOSTFILES / "localhost.hydra",
            "-n",
            "2",
            "python",
            "-c",
            "import os; os.write(1, f\"<rank {os.environ['PMI_RANK']}>\\n\".encode())",
        ]
    )  # one write each
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"<rank \d>", proc.stdout)) == ["<rank 0>", "<rank 1>"], proc.stdout


@pytest.mark.skipif(not _real_hydra() or shutil.which("eprt") is None, reason="needs Hydra and eprt on PATH")
def test_eprt_mpirun_converts_an_open_mpi_hostfile_for_real_hydra():
    proc = run([MPIRUN, "--hostfile", HOSTFILES / "localhost.openmpi", "env"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("EPRT_LOG_LEVEL") == 2  # `eprt env` printed by both ranks


def test_hostfiles_are_listed_in_the_readme():
    readme = (HOSTFILES / "README.md").read_text()
    files = sorted(p.name for p in HOSTFILES.iterdir() if p.name != "README.md")
    assert files and all(f"`{name}`" in readme for name in files)


# ---- SLURM's signal semantics: the tasks get SIGTERM and time to drain, never srun's SIGKILL ---------

SCALE = 0.1  # test seconds per SLURM second: --signal=TERM@120 comes 12 s before the limit
LIMIT_S = 22.0  # the job's time limit, in test seconds after srun starts


def slurm_tools(tmp_path: Path) -> Path:
    """bin/ with the fake srun and scancel of tests/fake_slurm.py and an `eprt` running this checkout."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = ROOT / "tests" / "fake_slurm.py"
    for tool in ("srun", "scancel"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" {tool} "$@"\n')
    (bin_dir / "eprt").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m eprt "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def job_signal_spec() -> str:
    text = (LAUNCH / "eprt.sbatch").read_text()
    return re.search(r"^#SBATCH --signal=(\S+)", text, re.M).group(1)


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("mpiexec"), reason="needs mpiexec (the fake srun starts its 2 tasks with it)")
@pytest.mark.parametrize("how", ["time limit", "signal to the batch shell"])
def test_sbatch_tasks_drain_on_sigterm_under_slurm_signal_semantics(tmp_path, how):
    """`eprt run` at -n 2 under the batch script. "time limit": the job's #SBATCH --signal fires;
    "signal to the batch shell": SIGTERM to the script itself (scancel --batch). Either way the
    tasks must get SIGTERM (not srun's SIGKILL), drain and exit before the limit: rank 0 exit 1
    (cut short), every record whole, a rerun resumes."""
    bin_dir = slurm_tools(tmp_path)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"line {i}: tell me about experts", "max_tokens": 48}) + "\n"
            for i in range(3000)
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPRT_", "SLURM_", "PMI", "OMPI_", "MPIEXEC"))}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        PYTHONPATH=str(ROOT),
        SLURM_JOB_ID="42",
        SLURM_NNODES="1",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="localhost",
        FAKE_SLURM_SCALE=str(SCALE),
        FAKE_SLURM_KILL_WAIT="30",
        FAKE_SLURM_TASKS_FILE=str(tmp_path / "tasks"),
        FAKE_SLURM_LIMIT=str(LIMIT_S if how == "time limit" else 600),
        FAKE_SLURM_SIGNAL=job_signal_spec(),
    )
    cmd = [
        "bash",
        "-c",
        'export FAKE_SLURM_BATCH_PID=$$; exec bash "$0" "$@"',  # what slurmd knows
        str(LAUNCH / "eprt.sbatch"),
        "run",
        "--device",
        "cpu",
        "--max-batch",
        "8",
        "--input",
        str(inp),
        "--output",
        str(out),
    ]
    log = tmp_path / "job.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            started = time.monotonic()
            if how == "signal to the batch shell":
                while not (out.exists() and out.read_text().count("\n") >= 8):
                    assert proc.poll() is None and time.monotonic() - started < 60, log.read_text()
                    time.sleep(0.05)
                os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=90)
            elapsed = time.monotonic() - started
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert "forcing job termination" not in text and "SIGKILL" not in text, text
    assert rc == 1, text  # cut short: exit 1, not 137
    assert "run the same command again to resume" in text, text
    if how == "time limit":
        assert "--signal=SIGTERM@120: SIGTERM to the tasks" in text and elapsed < LIMIT_S, text
    else:
        assert "scancel --signal=TERM: SIGTERM to the tasks" in text, text
    records = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole JSON
    assert 8 <= len(records) < 3000
    assert all("error" not in r and r["finish_reason"] in ("stop", "length") for r in records)


@pytest.mark.slow
def test_generate_drains_on_sigterm(tmp_path):
    """`eprt generate` (rank 0 of 2): SIGTERM lets the running prompts finish and prints them, the
    queued ones are reported not run, exit 1. Was: killed at once with nothing printed."""
    if not shutil.which("mpiexec"):
        pytest.skip("needs mpiexec")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPRT_", "SLURM_", "PMI", "OMPI_"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [
        "mpiexec",
        "-n",
        "2",
        sys.executable,
        "-m",
        "eprt",
        "generate",
        "--device",
        "cpu",
        "--max-batch",
        "2",
        "--max-tokens",
        "600",
        "--ignore-eos",
        "--json",
    ]
    for i in range(12):
        cmd += ["--prompt-ids", f"{i + 1},5,6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not _rank0_generating(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.0)
        for pid in _eprt_ranks(proc.pid):  # srun/SLURM signal every task
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    results = [json.loads(line) for line in out.splitlines()]
    assert proc.returncode == 1, err
    assert len(results) == 12  # one line per prompt, in order
    finished = [r for r in results if r["finish_reason"] == "length"]
    not_run = [r for r in results if r["finish_reason"] == "error"]
    assert 2 <= len(finished) < 12 and len(finished) + len(not_run) == 12
    assert all(len(r["token_ids"]) == 600 for r in finished)  # the running ones were not cut
    assert all(r["error"].startswith("not run:") for r in not_run)
    assert "SIGTERM: finishing the prompts already running" in err
    assert f"stopped by SIGTERM: {len(not_run)} of 12 prompts were not run" in err


def _eprt_ranks(mpiexec_pid: int) -> list:
    """The pids of the eprt processes mpiexec started (rank order not needed)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from proc_tree import cmdline, descendants

    return [p for p in descendants(mpiexec_pid) if "-m eprt" in cmdline(p)]


def _rank0_generating(mpiexec_pid: int) -> bool:
    """Both ranks are up and past loading: rank 0 catches SIGTERM (its drain handler), the
    workers ignore it; before that a SIGTERM would simply kill them."""
    ranks = _eprt_ranks(mpiexec_pid)
    return len(ranks) >= 2 and all(_handles_sigterm(pid) for pid in ranks)


def _handles_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigIgn", "SigCgt")}
    except (OSError, ValueError):
        return False
    bit = 1 << (signal.SIGTERM - 1)
    return bool((masks.get("SigIgn", 0) | masks.get("SigCgt", 0)) & bit)

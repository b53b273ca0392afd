"""The launchers in launch/ and the hostfiles in hostfiles/.

eprt-mpirun is run against a fake mpiexec (first on PATH, or named by $MPIEXEC) that
prints a chosen --version and echoes its arguments one per line, so every test sees
the exact command for each MPI flavour and hostfile format. The SLURM scripts run with
fake srun/scontrol the same way. The last tests use the real MPICH here.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
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
        + ECHO_ARGS.split("\n", 1)[1])
    (bin_dir / "srun").write_text(ECHO_ARGS)
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "gpu-a01\\ngpu-a02\\n"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def run(cmd: list, bin_dir: Path | None = None, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EPRT_", "SLURM_", "MPIEXEC"))}
    if bin_dir is not None:
        base["PATH"] = f"{bin_dir}:{base['PATH']}"
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**base, **env},
                          cwd=ROOT, timeout=60)


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
    ("intel", "two-nodes.hydra", ["--ranks-per-node", "4"],
     ["-n", "8", "-f", "hostfiles/two-nodes.hydra", "-ppn", "4"]),
    ("openmpi", "two-nodes.hydra", ["--ranks-per-node", "4"],
     ["-n", "8", "--host", "node001:8,node002:8", "--map-by", "ppr:4:node"]),
    ("openmpi", "two-nodes.openmpi", ["-n", "3"], ["-n", "3", "--hostfile", "hostfiles/two-nodes.openmpi"]),
    ("hydra", "two-nodes.openmpi", [], ["-n", "16", "-hosts", "node001:8,node002:8"]),
]


@pytest.mark.parametrize("flavour,hostfile,extra,expected", CASES,
                         ids=[f"{c[0]}-{c[1]}{'-' + '-'.join(c[2]) if c[2] else ''}" for c in CASES])
def test_dry_run_command_per_mpi_and_hostfile_format(tmp_path, flavour, hostfile, extra, expected):
    words = dry_run(tmp_path, flavour, "--hostfile", f"hostfiles/{hostfile}", *extra,
                    "serve", "--model", "/models/my moe")
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
    proc = run([MPIRUN, "-n", "2", "--ranks-per-node", "1", "run", "--input", "my prompts.jsonl"], bin_dir,
               MPIEXEC=str(renamed))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["-n", "2", "-ppn", "1", "eprt", "run", "--input", "my prompts.jsonl"]


@pytest.mark.parametrize("args,hostfile_text,message", [
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
])
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
    assert directives and all(" # " in line and line.split(" # ", 1)[1].strip() for line in directives), \
        "every #SBATCH line needs a comment"
    options = dict((line.split()[1].lstrip("-") + "=").split("=")[:2] for line in directives)
    assert options["ntasks-per-node"] == options["gpus-per-node"]          # one rank per GPU
    outside = run(["bash", LAUNCH / "eprt.sbatch", "serve"])
    assert outside.returncode == 2 and "not inside a SLURM allocation" in outside.stderr
    bin_dir = fake_tools(tmp_path, VERSIONS["openmpi"])
    inside = run(["bash", LAUNCH / "eprt.sbatch", "serve", "--model", "/m", "--host", "0.0.0.0"], bin_dir,
                 SLURM_JOB_ID="42", SLURM_NNODES="2", SLURM_NTASKS="16", SLURM_JOB_NODELIST="gpu-a[01-02]")
    assert inside.returncode == 0, inside.stderr
    srun_args = inside.stdout.splitlines()[2:]
    assert srun_args == ["--mpi=pmix", "--kill-on-bad-exit=1", "eprt", "serve", "--model", "/m", "--host", "0.0.0.0"]
    no_command = run(["bash", LAUNCH / "eprt.sbatch"], bin_dir, SLURM_JOB_ID="42")
    assert no_command.returncode == 2 and "no eprt command" in no_command.stderr


def test_interactive_script(tmp_path):
    outside = run([LAUNCH / "interactive.sh", "serve"])
    assert outside.returncode == 2 and "salloc" in outside.stderr
    bin_dir = fake_tools(tmp_path, VERSIONS["hydra"])
    slurm = dict(SLURM_JOB_ID="7", SLURM_NTASKS="16", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="8",
                 SLURM_JOB_NODELIST="gpu-a[01-02]")
    with_srun = run([LAUNCH / "interactive.sh", "serve", "--port", "9000"], bin_dir, **slurm)
    assert with_srun.returncode == 0, with_srun.stderr
    assert with_srun.stdout.splitlines() == ["--mpi=pmix", "--ntasks=16", "--kill-on-bad-exit=1",
                                             "eprt", "serve", "--port", "9000"]
    assert "rank 0 on gpu-a01" in with_srun.stderr
    with_mpirun = run([LAUNCH / "interactive.sh", "--mpirun", "serve"], bin_dir, **slurm)
    assert with_mpirun.returncode == 0, with_mpirun.stderr
    assert with_mpirun.stdout.splitlines() == ["-n", "16", "-ppn", "8", "eprt", "serve"]


def _real_hydra() -> bool:
    mpiexec = shutil.which("mpiexec")
    return mpiexec is not None and "HYDRA" in run([mpiexec, "--version"]).stdout


@pytest.mark.skipif(not _real_hydra(), reason="needs MPICH's Hydra mpiexec")
def test_localhost_hydra_hostfile_with_real_mpiexec():
    proc = run(["mpiexec", "-f", HOSTFILES / "localhost.hydra", "-n", "2", "python", "-c",
                "import os; os.write(1, f\"<rank {os.environ['PMI_RANK']}>\\n\".encode())"])   # one write each
    assert proc.returncode == 0, proc.stderr
    assert sorted(re.findall(r"<rank \d>", proc.stdout)) == ["<rank 0>", "<rank 1>"], proc.stdout


@pytest.mark.skipif(not _real_hydra() or shutil.which("eprt") is None, reason="needs Hydra and eprt on PATH")
def test_eprt_mpirun_converts_an_open_mpi_hostfile_for_real_hydra():
    proc = run([MPIRUN, "--hostfile", HOSTFILES / "localhost.openmpi", "env"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("EPRT_LOG_LEVEL") == 2          # `eprt env` printed by both ranks


def test_hostfiles_are_listed_in_the_readme():
    readme = (HOSTFILES / "README.md").read_text()
    files = sorted(p.name for p in HOSTFILES.iterdir() if p.name != "README.md")
    assert files and all(f"`{name}`" in readme for name in files)

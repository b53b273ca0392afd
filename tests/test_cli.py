"""The ``eprt`` command as a new user meets it (issue 36): a mistyped flag shows the sub-command's
usage and the flag meant; bad input exits 2 wherever it is caught, at one rank or two, and before
the model loads where it can; ``eprt plan`` on the built-in model by default, advice naming what
does not fit; ``eprt serve --help`` without the web stack; the README's serving example."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_server import running_server

from eprt import cli
from eprt.engine.engine import EngineConfig, launch_engine

ROOT = Path(__file__).resolve().parent.parent
LOADED = re.compile(r"read \d+ tensors")  # the log line of a rank that loaded its model


def eprt(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    return subprocess.run(
        [sys.executable, "-m", "eprt.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**environ, **(env or {})},
    )


def test_a_mistyped_flag_shows_the_subcommands_usage_and_the_flag_meant(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--promt", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: eprt generate ")
    assert "eprt generate: error: unrecognized arguments: --promt hi (--promt: did you mean --prompt?)" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--rank", "2", "--gpu-mme-gib=3"])  # --rank: argparse's own prefix match
    assert e.value.code == 2 and "--gpu-mme-gib: did you mean --gpu-mem-gib?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["generat", "--prompt", "hi"])
    assert e.value.code == 2 and "unknown command 'generat': did you mean 'generate'?" in capsys.readouterr().err


def test_serve_help_needs_no_web_stack():
    blocked = "import sys\nfor m in ('uvicorn', 'fastapi', 'starlette', 'pydantic', 'prometheus_client'):\n"
    blocked += "    sys.modules[m] = None\nfrom eprt.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    run = subprocess.run([sys.executable, "-c", blocked, "serve", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and "--default-max-tokens" in run.stdout, run.stderr
    run = subprocess.run([sys.executable, "-c", blocked, "serve"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "pip install 'eprt[serve]'" in run.stderr and not LOADED.search(run.stderr)


@pytest.mark.slow
def test_bad_input_exits_2_before_loading_where_it_can(tmp_path):
    out = tmp_path / "out.jsonl"
    cases = [
        (["run", "--input", str(tmp_path / "missing.jsonl"), "--output", str(out)], "--input"),
        (["run", "--input", __file__, "--output", str(tmp_path / "no" / "out.jsonl")], "does not exist"),
        (["generate", "--prompt", "hi", "--logprobs", "2"], "add --json"),
        (["generate", "--max-tokens", "3"], "give at least one --prompt"),
        (["generate", "--prompt", "hi", "--top-k", "-2"], "top_k"),
        (["serve", "--port", "99999"], "[0, 65535]"),
        (["serve", "--default-max-tokens", "-1"], "--default-max-tokens"),
        (["plan", "--ranks", "0"], "--ranks"),
    ]
    for args, says in cases:
        run = eprt(*args, "--device", "cpu") if args[0] != "plan" else eprt(*args)
        assert run.returncode == 2 and says in run.stderr, (args, run.stderr[-2000:])
        assert not LOADED.search(run.stderr), args
    assert not out.exists() and not (tmp_path / "no").exists()


def test_a_bad_prompt_exits_2_and_runs_no_prompt():
    run = eprt("generate", "--device", "cpu", "--prompt", "hi", "--prompt-ids", "99999", "--max-tokens", "2")
    assert run.returncode == 2 and "prompt 1: prompt token 99999 is outside the vocabulary" in run.stderr
    assert run.stdout == ""


@pytest.mark.slow
def test_two_ranks_exit_2_on_bad_input_too(tmp_path):
    """Launchers OR the ranks' exit codes: a worker exiting 1 beside rank 0's 2 made it 3."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    mpi = ["mpiexec", "-n", "2", sys.executable, "-m", "eprt.cli"]
    for args, says in [
        (["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"], "config.json"),
        (["run", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o.jsonl")], "--input"),
        (["generate", "--prompt-ids", "99999"], "outside the vocabulary"),
    ]:
        run = subprocess.run(
            [*mpi, *args, "--device", "cpu"], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT
        )
        assert run.returncode == 2 and says in run.stderr, (args, run.returncode, run.stderr[-3000:])
    assert not (tmp_path / "o.jsonl").exists()


def test_plan_defaults_to_the_built_in_model_and_names_what_does_not_fit(capsys):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("eprt plan: default_model (qwen3_moe, 1.84 M parameters) on 1 rank(s)")
    assert cli.main(["plan", "--gpu-mem-gib", "0.001"]) == 1
    problem = capsys.readouterr().out
    assert "the reserved 1 GiB (--reserved-gib: CUDA context, activations) alone exceeds" in problem
    assert "more ranks do not help" in problem and "use at least" not in problem
    assert cli.main(["plan", "--gpu-mem-gib", "0.001", "--reserved-gib", "0"]) == 1
    problem = capsys.readouterr().out
    ranks = int(re.search(r"the experts do not fit: use at least (\d+) ranks", problem).group(1))
    assert cli.main(["plan", "--gpu-mem-gib", "0.001", "--reserved-gib", "0", "--ranks", str(ranks)]) == 0  # true
    assert cli.main(["plan", "--gpu-mem-gib", "0.001", "--reserved-gib", "0", "--ranks", str(ranks - 1)]) == 1
    capsys.readouterr()
    assert cli.main(["plan", "--gpu-mem-gib", "0.0004", "--reserved-gib", "0", "--ranks", "8"]) == 1
    assert "leave no room for even one expert: more ranks do not help" in capsys.readouterr().out


def _readme_serving_example() -> tuple:
    """(the serve command, the JSON body) of the README's serving example."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(eprt serve[^\n]*)\n(.*?)```", readme, re.S)
    assert block, "the README's serving example (a bash block starting with eprt serve)"
    body = re.search(r"-d '(\{.*?\})'", block.group(2), re.S)
    return block.group(1), json.loads(body.group(1))


def test_the_readme_serving_example_answers():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("eprt serve") < readme.index("## What it is")  # in the README's first lines
    command, body = _readme_serving_example()
    assert command.split("#")[0].split() == ["eprt", "serve", "&"]  # the built-in model, no flag
    with launch_engine(EngineConfig(model=None, device="cpu")) as engine, running_server(engine) as url:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]

"""An empty or blank API key from any source is a start-up error, never a server without auth."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from test_server import ROOT

from eprt.serve.server import _settings, add_arguments
from eprt.serve.settings import HttpSettings


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("key", ["", " ", "\t"])
def test_an_empty_eprt_api_key_refuses_to_start(key):
    env = {**os.environ, "EPRT_API_KEY": key}
    out = subprocess.run(
        [sys.executable, "-m", "eprt.cli", "serve", "--model", "/nonexistent"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert f"EPRT_API_KEY is {key!r}: an empty key would turn authentication off" in out.stderr, out.stderr


def test_every_source_of_the_key(monkeypatch):
    monkeypatch.delenv("EPRT_API_KEY", raising=False)
    assert _settings(_args()).api_key is None  # neither: no authentication (allowed)
    monkeypatch.setenv("EPRT_API_KEY", "from-env")
    assert _settings(_args()).api_key == "from-env"
    assert _settings(_args("--api-key", "flag")).api_key == "flag"  # the flag wins
    monkeypatch.setenv("EPRT_API_KEY", "")
    with pytest.raises(ValueError, match="EPRT_API_KEY is ''"):
        _settings(_args())
    with pytest.raises(ValueError, match="--api-key is ''"):
        _settings(_args("--api-key", ""))
    for key in ("", "  "):  # the settings themselves, for a program calling serve()
        with pytest.raises(ValueError, match="an empty key would turn authentication off"):
            HttpSettings(api_key=key)

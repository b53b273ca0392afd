"""Exit 0 when tests/run_all.sh can skip pip: eprt imports from this tree and every requirement of
setup.cfg's install_requires and [test] extra is installed at an allowed version; else exit 1,
printing what is missing. Reads only installed metadata (no network, no imports of the packages)."""

from __future__ import annotations

import configparser
import importlib.metadata as md
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = cfg["options"]["install_requires"].splitlines() + cfg["options.extras_require"]["test"].splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def missing() -> list[str]:
    """The requirements not met here, each with what is installed."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv: pip decides
        return ["packaging (to check the others)"]
    out = []
    for line in requirements():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            out.append(f"{line} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{line} (installed: {version})")
    spec = importlib.util.find_spec("eprt")
    here = os.path.join(ROOT, "eprt", "__init__.py")
    if spec is None or not spec.origin or not os.path.samefile(spec.origin, here):
        out.append(f"eprt from {ROOT} (imports from {spec.origin if spec else 'nowhere'})")
    return out


if __name__ == "__main__":
    gone = missing()
    for line in gone:
        print(f"   missing: {line}")
    sys.exit(1 if gone else 0)

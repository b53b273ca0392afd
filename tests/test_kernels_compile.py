"""Every CUDA kernel compiles cleanly with nvcc, and exports exactly the entry points the
loader lists. Needs nvcc only (no GPU); skipped where nvcc is missing.

The sources are compiled to PTX for Ampere (sm_80) and Hopper (sm_90) with every nvcc
warning turned into an error, and stderr must be empty. Both architectures compile at
once (one nvcc process each, all files per process) to keep the test quick. Where CuPy
can load NVRTC (a GPU machine, or the nvidia-cuda-nvrtc wheel) the sources are also
compiled the way the loader compiles them at run time.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from eprt.ops.kernel_loader import COMPILE_OPTIONS, KERNELS, compile_options, cuda_include_dir, kernel_dir

NVCC = shutil.which("nvcc")
ARCHS = ("sm_80", "sm_90")
TIMEOUT_S = 300

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def entry_points(ptx_text: str) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx_text))


def _nvrtc():
    """CuPy's NVRTC binding when the library loads here, else None."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception:  # no cupy or no libnvrtc on this machine
        return None


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> dict[str, dict[str, str]]:
    """arch -> {file name -> PTX text}, compiling all sources for both archs in parallel."""
    src = kernel_dir()
    sources = sorted(src.glob("*.cu"))
    assert sources, f"no .cu files in {src}"
    procs = {}
    for arch in ARCHS:
        out = tmp_path_factory.mktemp(arch)
        cmd = [
            NVCC,
            "-ptx",
            f"-arch={arch}",
            *COMPILE_OPTIONS,
            "-Werror",
            "all-warnings",
            "-I",
            str(src),
            "-odir",
            str(out),
            *map(str, sources),
        ]
        procs[arch] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    result = {}
    for arch, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"nvcc -arch={arch} failed:\n{stderr}{stdout}"
        assert stderr.strip() == "", f"nvcc -arch={arch} printed diagnostics:\n{stderr}"
        result[arch] = {s.name: (out / (s.stem + ".ptx")).read_text() for s in sources}
    return result


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_warnings(ptx, arch):
    assert set(ptx[arch]) == {p.name for p in kernel_dir().glob("*.cu")}
    for name, text in ptx[arch].items():
        assert ".entry" in text, f"{name} compiled for {arch} has no kernel entry point"


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_entry_points_match_the_loader_table(ptx, arch):
    on_disk = {p.name for p in kernel_dir().glob("*.cu")}
    assert on_disk == set(KERNELS), "kernel_loader.KERNELS must list every .cu file and no other"
    for name, text in ptx[arch].items():
        entries = entry_points(text)
        assert entries == set(KERNELS[name]), (
            f"{name}: PTX entry points {sorted(entries)} != loader table {sorted(KERNELS[name])}"
        )


@needs_nvcc
def test_kernels_use_no_local_memory_arrays_by_accident(ptx):
    """Register arrays indexed by runtime values spill to local memory (slow); the kernels
    index theirs only with unrolled constants. A .local declaration in PTX means one slipped."""
    for name, text in ptx["sm_90"].items():
        assert ".local" not in text, f"{name} declares local memory (a dynamically indexed array?)"


@pytest.mark.skipif(_nvrtc() is None, reason="CuPy cannot load NVRTC here")
@pytest.mark.parametrize("arch", ("compute_80", "compute_90"))
def test_kernels_compile_with_nvrtc_as_at_run_time(arch):
    nvrtc = _nvrtc()
    src, include = kernel_dir(), cuda_include_dir()
    assert include is not None, "no CUDA include directory with cuda_bf16.h found"
    options = (*compile_options(src), f"-I{include}", f"-arch={arch}")
    for path in sorted(src.glob("*.cu")):
        prog = nvrtc.createProgram(path.read_text(), path.name, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, list(options))
            except nvrtc.NVRTCError as e:
                pytest.fail(f"{path.name} ({arch}): {e}\n{nvrtc.getProgramLog(prog)}")
            log = nvrtc.getProgramLog(prog).strip("\x00").strip()
            assert log == "", f"{path.name} ({arch}) compiled with diagnostics:\n{log}"
            assert entry_points(nvrtc.getPTX(prog).decode()) == set(KERNELS[path.name])
        finally:
            nvrtc.destroyProgram(prog)

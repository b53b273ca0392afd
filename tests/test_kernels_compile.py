"""Every CUDA kernel compiles cleanly with nvcc, exports exactly the entry points the loader
lists, and fits its resource budget at the largest launch the host makes of it. Needs nvcc only
(no GPU); skipped where nvcc is missing.

The sources are compiled to PTX for Ampere (sm_80) and Hopper (sm_90) with every nvcc
warning turned into an error, and stderr must be empty. Both architectures compile at
once (one nvcc process each, all files per process) to keep the test quick; ptxas -v then
assembles every PTX file (in parallel) and reports each kernel's registers, spills, stack and
static shared memory. The budget (``kernel_loader.LAUNCH``: the host caps its block sizes
there): no spill or stack frame; registers x threads of the largest block within the SM's
register file; the largest block within the kernel's __launch_bounds__; static shared memory
within 48 KB plus the fixed dynamic part, and none beside a dynamic part that may take the whole
opt-in carve-out. Where CuPy can load NVRTC (a GPU machine, or the nvidia-cuda-nvrtc wheel) the
sources are also compiled the way the loader compiles them at run time.

``python3 tests/test_kernels_compile.py`` prints the budget table of docs/gpu.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from eprt.ops.kernel_loader import COMPILE_OPTIONS, KERNELS, LAUNCH, compile_options, cuda_include_dir, kernel_dir

NVCC = shutil.which("nvcc")
PTXAS = shutil.which("ptxas") or (NVCC and shutil.which("ptxas", path=str(__import__("pathlib").Path(NVCC).parent)))
ARCHS = ("sm_80", "sm_90")
TIMEOUT_S = 300
REGISTER_FILE = 65536  # 32-bit registers per block and per SM on sm_80 and sm_90 (regsPerBlock)
STATIC_SMEM_MAX = 48 * 1024  # static + non-opted-in dynamic shared memory per block
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256


@dataclass(frozen=True)
class Resources:
    """What ptxas -v reports for one kernel, and the PTX's __launch_bounds__ (.maxntid)."""

    registers: int
    spill_bytes: int  # stores + loads
    stack_bytes: int
    static_smem: int
    max_threads: int | None

    def block_registers(self, threads: int) -> int:
        """Registers a block of ``threads`` takes from the SM's file."""
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        return per_warp * -(-threads // 32)


def needs_nvcc(test):
    """Skipped without nvcc; slow (nvcc and ptxas over every kernel, for two architectures)."""
    return pytest.mark.slow(pytest.mark.skipif(NVCC is None, reason="nvcc not found")(test))


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


def parse_ptxas(stderr: str, ptx_text: str) -> dict[str, Resources]:
    """kernel name -> Resources from ptxas -v's report on one PTX file."""
    found: dict[str, dict] = {}
    name = None
    for line in stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
            found[name] = {"smem": 0}
        elif name and (
            m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        ):
            found[name].update(stack=int(m.group(1)), spill=int(m.group(2)) + int(m.group(3)))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            found[name]["registers"] = int(m.group(1))
            if sm := re.search(r"(\d+) bytes smem", line):
                found[name]["smem"] = int(sm.group(1))
    bounds = dict(re.findall(r"\.entry\s+(\w+)\s*\([^{]*?\.maxntid\s+(\d+)", ptx_text, re.S))
    return {
        k: Resources(v["registers"], v["spill"], v["stack"], v["smem"], int(bounds[k]) if k in bounds else None)
        for k, v in found.items()
    }


@pytest.fixture(scope="module")
def resources(ptx, tmp_path_factory) -> dict[str, dict[str, Resources]]:
    """arch -> {kernel -> Resources}: ptxas -v on every PTX file, in parallel."""
    assert PTXAS, "ptxas not found beside nvcc"
    out = tmp_path_factory.mktemp("cubin")

    def assemble(arch: str, name: str, text: str):
        src = out / f"{arch}-{name}.ptx"
        src.write_text(text)
        cmd = [PTXAS, f"-arch={arch}", "-v", "--warning-as-error", str(src), "-o", str(src.with_suffix(".cubin"))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"ptxas {arch} {name} failed:\n{proc.stderr}"
        return arch, parse_ptxas(proc.stderr, text)

    jobs = [(arch, name, text) for arch in ARCHS for name, text in ptx[arch].items()]
    result: dict[str, dict[str, Resources]] = {arch: {} for arch in ARCHS}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for arch, found in pool.map(lambda job: assemble(*job), jobs):
            result[arch].update(found)
    return result


def budget_problems(name: str, r: Resources) -> list[str]:
    """Why kernel ``name`` (its resources ``r``) cannot run the largest launch the host makes of it."""
    most = LAUNCH[name]
    problems = []
    if r.spill_bytes or r.stack_bytes:
        problems.append(f"spills {r.spill_bytes} bytes, stack frame {r.stack_bytes} bytes")
    if r.block_registers(most.threads) > REGISTER_FILE:
        problems.append(
            f"{r.registers} registers x {most.threads} threads = {r.block_registers(most.threads)} > {REGISTER_FILE} "
            "(too many resources requested for launch)"
        )
    if r.max_threads is not None and most.threads > r.max_threads:
        problems.append(f"launched with {most.threads} threads, above its __launch_bounds__({r.max_threads})")
    if most.smem is None and r.static_smem:
        problems.append(f"{r.static_smem} bytes of static shared memory beside an opt-in dynamic part")
    if most.smem is not None and r.static_smem + most.smem > STATIC_SMEM_MAX:
        problems.append(f"{r.static_smem} + {most.smem} bytes of shared memory without the opt-in")
    return problems


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_fits_its_resource_budget_at_the_hosts_largest_launch(resources, arch):
    assert set(resources[arch]) == set(LAUNCH), "ptxas must report on every entry point of kernel_loader.LAUNCH"
    problems = {name: budget_problems(name, r) for name, r in sorted(resources[arch].items())}
    bad = {name: p for name, p in problems.items() if p}
    assert not bad, f"{arch}: " + "; ".join(f"{name}: {', '.join(p)}" for name, p in bad.items())


def test_the_budget_check_catches_each_excess():
    """The check itself, on made-up reports: a spill, 255 registers at 1024 threads, launch
    bounds, static shared memory beside an opt-in part, and over 48 KB."""
    ok = Resources(32, 0, 0, 0, None)
    assert budget_problems("rms_norm", ok) == []
    assert "spills" in budget_problems("rms_norm", Resources(32, 20, 24, 0, None))[0]
    assert "too many resources" in budget_problems("argmax_f32", Resources(255, 0, 0, 0, None))[0]
    assert "__launch_bounds__(128)" in budget_problems("argmax_f32", Resources(32, 0, 0, 0, 128))[0]
    assert "beside an opt-in" in budget_problems("mla_attention", Resources(32, 0, 0, 16, None))[0]
    assert "without the opt-in" in budget_problems("rms_norm", Resources(32, 0, 0, 49 * 1024, None))[0]


def budget_table(resources) -> str:
    """The markdown table of docs/gpu.md: per kernel, the largest launch and what it takes."""
    rows = [
        "| kernel | largest block | dynamic smem | registers sm_80 / sm_90 | registers x threads (sm_90) "
        "| spills | static smem |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(LAUNCH):
        most, a, h = LAUNCH[name], resources["sm_80"][name], resources["sm_90"][name]
        smem = "opt-in (host-checked)" if most.smem is None else f"{most.smem} B"
        spills = max(a.spill_bytes + a.stack_bytes, h.spill_bytes + h.stack_bytes)
        rows.append(
            f"| `{name}` | {most.threads} | {smem} | {a.registers} / {h.registers} | "
            f"{h.block_registers(most.threads)} of {REGISTER_FILE} | {spills} | {max(a.static_smem, h.static_smem)} B |"
        )
    return "\n".join(rows)


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


if __name__ == "__main__":  # the table of docs/gpu.md
    import tempfile

    class _Factory:
        def mktemp(self, name):
            return __import__("pathlib").Path(tempfile.mkdtemp(prefix=name))

    texts = ptx.__wrapped__(_Factory())
    print(budget_table(resources.__wrapped__(texts, _Factory())))

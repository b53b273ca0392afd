"""pytest plugin: run the GPU tests on cusim instead of a GPU.

    PYTHONPATH=tests python3 -m pytest -p cusim.plugin -m gpu tests/test_cupy_ops.py ...

Installs the CuPy stand-in (``fake_cupy``) before any test module imports ``cupy``, so
``eprt.ops.device.cuda_usable()`` is true and the ``gpu``-marked tests run the real
``kernels/*.cu`` sources through the simulator and ``CupyOps`` unchanged.
"""

from . import fake_cupy


def pytest_configure(config):
    fake_cupy.install()
    config.addinivalue_line("markers", "gpu: needs a CUDA device (here: cusim)")


def pytest_report_header(config):
    return "cusim: CUDA kernels run on the CPU simulator (tests/cusim), not on a GPU"

"""Every library kernel's CUDA C source compiles with NVRTC, with no GPU needed.

NVRTC (``nvidia-cuda-nvrtc-cu12``, reached through CuPy's bindings) compiles for a virtual
architecture without a device, so this runs wherever the test set-up installed CuPy
(``bash setup.sh --test``); it skips with the reason only where CuPy is missing. A CuPy that
cannot load NVRTC fails here: the cuda backend could not compile any kernel either.
"""

from __future__ import annotations

import pytest

from helpers import backend_module_or_skip, library_kernels

backend_module_or_skip("cuda", "bash setup.sh --test installs cupy-cuda12x")
from cupy_backends.cuda.libs import nvrtc  # noqa: E402 - only after the skip above

#: a virtual architecture old enough (Volta, sm_70) that sources using newer features fail here.
ARCH = "--gpu-architecture=compute_70"
KERNELS = library_kernels()


def test_nvrtc_loads():
    try:
        major, _ = nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - any failure: the set-up misses NVRTC
        pytest.fail(f"CuPy is installed but NVRTC does not load ({type(e).__name__}: {e}); "
                    "pip install nvidia-cuda-nvrtc-cu12 (bash setup.sh --test)")
    assert major >= 12


def test_every_library_kernel_has_a_cuda_source():
    assert "runtime.kernels.pointwise.add" in KERNELS and len(KERNELS) > 30
    assert not [name for name, k in KERNELS.items() if not k.cuda]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_cuda_source_compiles(name):
    kernel = KERNELS[name]
    prog = nvrtc.createProgram(kernel.cuda, f"{kernel.name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [ARCH])
    except Exception as e:  # noqa: BLE001 - NVRTC's log says what is wrong
        pytest.fail(f"{name}: {type(e).__name__}: {e}\n{nvrtc.getProgramLog(prog)}")
    finally:
        nvrtc.destroyProgram(prog)

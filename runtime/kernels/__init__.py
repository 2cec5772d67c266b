"""The standard kernel library (design.md section 2): each kernel one backend-neutral
description with a numpy, a WGSL and a CUDA C source.

Elementwise kernels take their element count ``n`` as the last param and are launched over
``grid(n)`` workgroups of 64 invocations.
"""

from .elementwise import (WORKGROUP, grid, elementwise, fill, copy, add, mul, add_scalar,
                          mul_scalar, accumulate, noop)

__all__ = ["WORKGROUP", "grid", "elementwise", "fill", "copy", "add", "mul", "add_scalar",
           "mul_scalar", "accumulate", "noop"]

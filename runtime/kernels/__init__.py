"""The standard kernel library (docs/contract.md section 2): each kernel one backend-neutral
description with a numpy, a WGSL and a CUDA C source.

Elementwise kernels take their element count ``n`` as the last param and are launched over
``grid(n)`` workgroups of 64 invocations.
"""

from .pointwise import (WORKGROUP, grid, elementwise, fill, copy, add, mul, add_scalar,
                          mul_scalar, accumulate, copy_words, noop)
from .nn import (gelu, add_bias, embedding, matmul, matmul_bias, matmul_bias_gelu, matmul_count,
                 layer_norm, add_layer_norm, l2_normalize, rows_count, mean_pool, attention,
                 attention_for, attention_count, matmul_for)

__all__ = ["WORKGROUP", "grid", "elementwise", "fill", "copy", "add", "mul", "add_scalar",
           "mul_scalar", "accumulate", "copy_words", "noop",
           # nn.py: transformer encoder kernels
           "gelu", "add_bias", "embedding", "matmul", "matmul_bias", "matmul_bias_gelu",
           "matmul_count", "layer_norm", "add_layer_norm", "l2_normalize", "rows_count",
           "mean_pool", "attention", "attention_for", "attention_count", "matmul_for"]

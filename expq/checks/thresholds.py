"""The limits ``verify`` holds the kernel and the dequantized rows to, with their reasoning."""

from __future__ import annotations

import torch

# Kernel vs the fp32 reference on the same (dequantized) weights: the only differences are roundings. In bf16 each of
# the activation cast, the GEMM1 cache, the activation output and GEMM2's cast rounds to 2^-9 relative; a few such
# roundings through two GEMMs give ~0.5% relative on a layer's output; 2% leaves room without hiding a wrong scale
# (a doubled scale on one of E experts moves the layer by >> 2%). fp16 has 3 more mantissa bits, fp32 none lost.
KERNEL_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# The worst single token sees fewer experts, so less averaging: 4x the layer bound.
KERNEL_TOKEN_TOL = {k: 4 * v for k, v in KERNEL_REL_TOL.items()}
# Against the source's own experts, the int8 error adds up: per-row absmax/127 steps give ~0.3-1% relative error
# per GEMM on Gaussian-like weights, two GEMMs and the activation compound it; 6% flags a wrong scale or codes
# without flagging honest int8 noise on outlier-heavy rows.
SOURCE_REL_TOL = 6e-2
# Dequantization error allowed per row, in steps of its scale: half a step from round(), plus the scheme's first
# rounding of w/scale to the compute dtype, at most half its spacing below 128 (64 * u: 0.25 in bf16, 1/32 in fp16).
# A rounded-down scale can push the absmax element's quotient to 127(1 + u) and the clamp then costs < 127u, which
# stays under the same bound. (u = unit roundoff of the dtype; +1e-3 for the fp32 arithmetic of the check itself.)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def row_error_limit(dtype: torch.dtype) -> float:
    """The largest |w - q*s| / s the experts_int8 scheme can give in ``dtype`` (see above)."""
    return 0.5 + 64 * UNIT_ROUNDOFF[dtype] + 1e-3

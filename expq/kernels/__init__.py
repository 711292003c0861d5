"""Fused MoE for experts_int8 weights (int8 codes, per-output-row fp32 scales; 16-bit activations).

Public API:

* ``fused_moe_int8``: the routed experts, Triton kernel on CUDA (``backend="triton"``), plain torch elsewhere;
* ``moe_reference``: the same in fp32 from dequantized weights (the yardstick);
* ``moe_reference_dense``: the same in fp32 from unquantized (source) weights;
* ``select_backend``: which backend ``"auto"`` resolves to on a device;
* ``ACTIVATIONS``: the supported gate/up activations.

Triton is imported only when the Triton backend runs.
"""

from .moe import ACTIVATIONS, fused_moe_int8, moe_reference, moe_reference_dense, select_backend

__all__ = ["ACTIVATIONS", "fused_moe_int8", "moe_reference", "moe_reference_dense", "select_backend"]

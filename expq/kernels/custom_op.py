"""``fused_moe_int8`` as a torch custom op, ``torch.ops.expq.fused_moe_int8``, for engines that compile and capture.

torch.compile sees the op as one opaque node: its fake implementation gives the output's shape and dtype (that of
``hidden_states``), so Dynamo never traces into the Triton launches and the graph does not break around it (a
``fullgraph=True`` compile succeeds). CUDA graphs capture it: the Triton pipeline never synchronises with the host
(no ``.item()``, no CPU tensor, no data-dependent shape; the expert-id range check runs on CPU tensors only), and
the buffers it allocates per call are fixed in the graph's memory pool when captured, sized by the captured batch.

The op is registered once per process, on first import of this module (a re-import finds it registered). Its
arguments are ``fused_moe_int8``'s, all positional: hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
topk_ids, w13_bias (or None), w2_bias (or None), expert_map (or None), activation, apply_router_weight_on_input,
backend. The result is a new tensor [T, H] in hidden_states' dtype (never a view of an input).
"""

from typing import Optional

import torch

from .moe import fused_moe_int8

OP_NAME = "expq::fused_moe_int8"


def _impl(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
          w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
          w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], expert_map: Optional[torch.Tensor],
          activation: str, apply_router_weight_on_input: bool, backend: str) -> torch.Tensor:
    return fused_moe_int8(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation=activation,
                          w13_bias=w13_bias, w2_bias=w2_bias,
                          apply_router_weight_on_input=apply_router_weight_on_input, backend=backend,
                          expert_map=expert_map)


def _fake(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, w13_bias, w2_bias, expert_map,
          activation, apply_router_weight_on_input, backend):
    return hidden_states.new_empty(hidden_states.shape)


def _register():
    try:
        return torch.ops.expq.fused_moe_int8  # registered by an earlier import of this module in this process
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(OP_NAME, mutates_args=())(_impl)
    op.register_fake(_fake)
    return torch.ops.expq.fused_moe_int8


fused_moe_int8_op = _register()
"""``torch.ops.expq.fused_moe_int8`` (see the module docstring)."""

"""vLLM baselines of bench/bench_kernel.py --compare: each a builder that takes one shape's weights and returns a
``run(x, topk_weights, topk_ids)`` callable, or raises ``Unavailable`` with the reason.

All three call vLLM's own ops as vLLM 0.24 calls them (read from its source, not copied):

* ``vllm-bf16``: ``vllm.model_executor.layers.fused_moe.fused_moe.fused_experts`` with bf16 weights (the dequantized
  int8 weights; vLLM's tuned H200 configs where it ships them);
* ``vllm-int8``: the same ``fused_experts`` with ``quant_config=int8_w8a16_moe_quant_config(w1_scale, w2_scale)``:
  0.24's form of the old ``use_int8_w8a16=True`` (``fused_experts`` no longer takes that keyword; it forwards
  ``quant_config.use_int8_w8a16`` to ``torch.ops.vllm.fused_experts``): the experts_int8 path, int8 codes and fp32
  per-row scales exactly as expq's kernel reads them;
* ``marlin``: ``fused_marlin_moe`` (``fused_moe/experts/marlin_moe.py``) with the weights of a compressed-tensors
  W8A16 channel checkpoint (``expq.formats.compressed_tensors.pack_codes``: int32 words of codes + 128, scales in the
  activation dtype), laid out as vLLM loads them for Marlin (``CompressedTensorsWNA16MarlinMoEMethod``:
  ``is_transposed``, w13 [E, H/4, 2I] with gate then up, w2 [E, I/4, H], scales [E, 1, N]) and converted as its
  ``process_weights_after_loading`` does (``oracle/int_wna16._process_weights_marlin``: ``gptq_marlin_moe_repack``
  with empty sort indices, ``marlin_moe_permute_scales`` with group_size -1), ``quant_type uint8b128``, empty
  g_idx, ``is_k_full``, one workspace (``marlin_make_workspace_new(device, 4)``).

vLLM must be importable (on the device machine: PYTHONPATH=/tmp/site after the offline-vllm install). Call the
builders inside ``vllm_context()``: vLLM's ops read the current VllmConfig.
"""

from __future__ import annotations

import contextlib

import torch


class Unavailable(Exception):
    """A baseline cannot run here (vLLM or one of its ops missing); the message says why."""


def _import(what, fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any import failure: this baseline is skipped
        raise Unavailable(f"{what} not importable ({type(exc).__name__}: {str(exc)[:200]})") from None


def vllm_context():
    """``set_current_vllm_config(VllmConfig())`` when vLLM imports, else a null context."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config

        return set_current_vllm_config(VllmConfig())
    except Exception as exc:  # noqa: BLE001 - no vLLM: the baselines say so themselves
        print(f"# no vLLM config context ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
        return contextlib.nullcontext()


def vllm_bf16(w13_bf, w2_bf, **_):
    def imp():
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        return fused_experts

    fused_experts = _import("vLLM fused_experts", imp)
    return lambda x, tw, ti: fused_experts(x, w13_bf, w2_bf, tw, ti)


def vllm_int8(w13, w2, s13, s2, **_):
    def imp():
        from vllm.model_executor.layers.fused_moe.config import int8_w8a16_moe_quant_config
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        return fused_experts, int8_w8a16_moe_quant_config

    fused_experts, qc_fn = _import("vLLM fused_experts / int8_w8a16_moe_quant_config", imp)
    qc = qc_fn(w1_scale=s13, w2_scale=s2)
    return lambda x, tw, ti: fused_experts(x, w13, w2, tw, ti, quant_config=qc)


def compressed_tensors_marlin_layout(w13, w2, s13, s2, dtype):
    """The tensors vLLM's CompressedTensorsWNA16MarlinMoEMethod holds after loading a compressed-tensors W8A16
    channel checkpoint of these experts, before its repack: (w13_weight_packed int32 [E, H/4, 2I],
    w2_weight_packed int32 [E, I/4, H], w13_weight_scale [E, 1, 2I], w2_weight_scale [E, 1, H]) in ``dtype``.

    Per expert the checkpoint holds gate/up/down ``weight_packed`` = pack_codes(codes) [out, in/4] and
    ``weight_scale`` [out, 1]; vLLM's loader transposes each into the stacked parameter (gate in columns 0..I-1,
    up in I..2I-1). pack_codes works row by row, so packing w13[e] = [gate; up] at once gives the same words."""
    from expq.formats.compressed_tensors import pack_codes

    e_dim, two_i, h = w13.shape
    i_dim = two_i // 2
    p13 = torch.empty(e_dim, h // 4, two_i, dtype=torch.int32, device=w13.device)
    p2 = torch.empty(e_dim, i_dim // 4, h, dtype=torch.int32, device=w13.device)
    for e in range(e_dim):
        p13[e] = pack_codes(w13[e].clone()).t()
        p2[e] = pack_codes(w2[e].clone()).t()
    return p13, p2, s13.to(dtype)[:, None, :].contiguous(), s2.to(dtype)[:, None, :].contiguous()


def marlin(w13, w2, s13, s2, dtype, **_):
    if w13.shape[2] % 64 or w2.shape[2] % 64:
        raise Unavailable("Marlin MoE needs H and I multiples of 64")

    def imp():
        import vllm._custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_make_workspace_new,
            marlin_moe_permute_scales,
        )
        from vllm.scalar_type import scalar_types

        if not hasattr(ops, "gptq_marlin_moe_repack"):
            raise ImportError("vllm._custom_ops.gptq_marlin_moe_repack missing")
        return ops, fused_marlin_moe, marlin_make_workspace_new, marlin_moe_permute_scales, scalar_types

    ops, fused_marlin_moe, make_ws, permute_scales, scalar_types = _import("vLLM Marlin MoE ops", imp)
    p13, p2, cs13, cs2 = compressed_tensors_marlin_layout(w13, w2, s13, s2, dtype)
    e_dim, two_i, _ = w13.shape
    i_dim = two_i // 2
    pack_factor = 4  # 32 // 8 bits
    empty = torch.empty((e_dim, 0), dtype=torch.int32, device=w13.device)
    try:
        m13 = ops.gptq_marlin_moe_repack(p13, empty, p13.shape[1] * pack_factor, p13.shape[2], 8, is_a_8bit=False)
        m2 = ops.gptq_marlin_moe_repack(p2, empty, p2.shape[1] * pack_factor, p2.shape[2], 8, is_a_8bit=False)
        ms13 = permute_scales(s=cs13, size_k=i_dim, size_n=cs13.shape[2], group_size=-1, is_a_8bit=False)
        ms2 = permute_scales(s=cs2, size_k=cs2.shape[1] * pack_factor, size_n=cs2.shape[2], group_size=-1,
                             is_a_8bit=False)
        workspace = make_ws(w13.device, 4)
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"Marlin repack failed ({type(exc).__name__}: {str(exc)[:200]})") from None
    del p13, p2
    qtype = scalar_types.uint8b128.id

    def run(x, tw, ti):
        return fused_marlin_moe(x, m13, m2, None, None, ms13, ms2, tw, ti, quant_type_id=qtype,
                                global_num_experts=e_dim, g_idx1=empty, g_idx2=empty, sort_indices1=empty,
                                sort_indices2=empty, workspace=workspace, is_k_full=True)

    return run


BASELINES = {"vllm-bf16": vllm_bf16, "vllm-int8": vllm_int8, "marlin": marlin}
"""name -> builder(w13=, w2=, s13=, s2=, w13_bf=, w2_bf=, dtype=) -> run(x, topk_weights, topk_ids)."""

WEIGHT_BYTES_PER_ELEMENT = {"vllm-bf16": 2, "vllm-int8": 1, "marlin": 1}

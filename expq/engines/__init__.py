"""Serving engines' hooks for converted checkpoints.

* ``moe_loading``: pure torch; puts a converted checkpoint's per-projection experts_int8 tensors into a vLLM-style
  fused-MoE layer's parameters (tensor and expert parallelism), and tracks that every piece arrived.
* ``vllm``: the vLLM plugin (entry point ``vllm.general_plugins``: ``expq.engines.vllm:register``). vLLM is imported
  only when the plugin is called, never by ``import expq``.
"""

"""Small, real-format MoE checkpoints made with transformers on the CPU (no download): the demo's built-in example
and the test suite's fixtures.

``build_example(family, path)`` instantiates the family's transformers model from a tiny config
(``AutoConfig.for_model`` + ``from_config``), gives it a seeded random initialisation, and writes it with
``save_pretrained`` (several shards when ``max_shard_size`` is small), plus a small byte-level BPE tokenizer.

``preset="serve"`` builds a larger fixture that vLLM 0.24 starts (``SERVE_FAMILIES``, or, for a family with a layout
file but no entry there, dims derived from that layout's config keys): hidden 256, 8 experts, top-2, 4 layers,
``max_position_embeddings`` 1024. ``init_std`` sets the weights' standard deviation (``bench/vllm_compare.py`` uses
0.02: the default 0.05 amplifies arithmetic differences to several nats). The defaults (``preset="tiny"``,
``init_std=0.05``) write the same bytes as before these options existed (``tests/test_goldens.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

# Tiny configs per fixture family. Sizes are chosen so that H != I and H != 2I (orientation mistakes show up as
# shape errors), with dense layers where the family has them.
H, I, VOCAB = 64, 48, 320
FAMILIES: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=I),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=I),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=I, intermediate_size=80,
                      shared_expert_intermediate_size=40, mlp_only_layers=[1], num_hidden_layers=3),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=I, intermediate_size=80,
                      head_dim=16, decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=I, intermediate_size=80,
                        first_k_dense_replace=1, n_shared_experts=1, num_key_value_heads=4, n_group=1, topk_group=1,
                        kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_hidden_layers=3),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=I),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=I),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=I, intermediate_size_mlp=80,
                        interleave_moe_layer_step=2, num_hidden_layers=4, head_dim=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=I, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "dbrx": dict(d_model=H, n_layers=2, n_heads=4, max_seq_len=128,
                 ffn_config=dict(ffn_hidden_size=I, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
}
COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              max_position_embeddings=128, tie_word_embeddings=False)

# preset="serve": fixtures vLLM 0.24 starts (serving needs max_model_len 512 <= the position limit). Why each entry
# differs from the tiny one is said next to it.
SERVE_COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=1024,
                    tie_word_embeddings=False)
SERVE_FAMILIES: dict[str, dict] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512, mlp_only_layers=[1], decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    # vLLM builds e_score_correction_bias (which transformers saves) only for topk_method noaux_tc; its MLA backends
    # take kv_lora_rank + qk_rope_head_dim in (320, 576) (MLACommonBackend.get_supported_head_sizes; FlashAttn-MLA,
    # first on Hopper, runs q_pe at head dim 64 with kv_lora_rank as the value dim): 256 + 64, the smaller of the two.
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, first_k_dense_replace=1,
                        n_shared_experts=1, num_attention_heads=8, num_key_value_heads=8, n_group=1, topk_group=1,
                        topk_method="noaux_tc", scoring_func="sigmoid", kv_lora_rank=256, q_lora_rank=256,
                        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128, head_dim=64),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=256),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256),
    # Llama-4 routes top-1 (vLLM's Llama4MoE routing is top-1 sigmoid).
    "llama4_text": dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=256, intermediate_size_mlp=512,
                        interleave_moe_layer_step=2),
    # GPT-OSS as released: head_dim 64 (FlashAttention with sinks), H = I, 8 query heads, every other layer a
    # 128-token sliding window, YaRN from 4096 positions (vLLM reads factor/beta_fast/beta_slow/original_max_...).
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256, num_attention_heads=8,
                    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128,
                    max_position_embeddings=131072),
    # DBRX's position limit is max_seq_len (the tiny fixture's 128 is below vLLM's max_model_len 512); head dim 64.
    "dbrx": dict(d_model=256, n_layers=4, n_heads=4, max_seq_len=1024, vocab_size=1024, tie_word_embeddings=False,
                 ffn_config=dict(ffn_hidden_size=256, moe_num_experts=8, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
    # families with a layout file but no tiny fixture: the derived dims plus what each one needs
    "glm4_moe": dict(n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1),
    "dots1": dict(n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1),
    "ernie4_5_moe": dict(moe_layer_start_index=1),
    "minimax": dict(layer_types=["linear_attention", "full_attention"] * 2),
    # transformers sizes HunYuan's experts by intermediate_size, expq's layout reads moe_intermediate_size first: real
    # configs (Hunyuan-A13B) have both equal, so does this one
    "hunyuan_v1_moe": dict(intermediate_size=256),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
}
SERVE_NOT_DERIVED = {"dbrx"}  # families whose config does not use the common key names


def serve_config(family: str) -> dict:
    """The ``preset="serve"`` config fields of ``family``: ``SERVE_COMMON``, expert dims (8 experts, top-2, I 256)
    under the keys the family's layout file names, then ``SERVE_FAMILIES[family]``.

    Raises:
        KeyError: no layout file lists ``family`` as a model type.
    """
    if family in SERVE_NOT_DERIVED:
        return dict(SERVE_FAMILIES[family])
    from .layouts import builtin_layouts

    layout = next((lay for lay in builtin_layouts() if family in lay.model_types), None)
    if layout is None:
        raise KeyError(f"no layout file lists model type {family!r}")
    kw = dict(SERVE_COMMON)
    keys = layout.keys
    kw[keys["num_experts"][0]] = 8
    kw[keys["top_k"][0]] = 2
    if keys["intermediate_size"][0] != "intermediate_size":
        kw[keys["intermediate_size"][0]] = 256
    for rule, value in (("first_k_dense_replace", 1), ("mlp_only_layers", []), ("decoder_sparse_step", 1)):
        if rule in layout.moe_layer_rules:
            kw[rule] = value
    kw.update(SERVE_FAMILIES.get(family, {}))
    return kw


_CORPUS = ("Mixture-of-experts models route each token to a few experts. The router picks the top-k experts and "
           "their outputs are summed with the router weights. Quantizing the routed experts to int8 halves the "
           "bytes to download, store and load. ") * 4


def build_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """Train a tiny byte-level BPE tokenizer on a built-in text and save it (tokenizer.json and friends)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def build_example(family: str, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                  max_shard_size: str = "200KB", tokenizer: bool = True, preset: str = "tiny",
                  init_std: float = 0.05, lm_head_std: float | None = None, **overrides) -> Path:
    """Write a tiny ``family`` checkpoint (one of ``FAMILIES``) to ``path`` and return the path.

    Args:
        preset: ``"tiny"`` (``FAMILIES``, the test fixtures) or ``"serve"`` (``serve_config``: sizes vLLM starts; any
            family with a layout file that transformers instantiates).
        init_std: standard deviation of the random weights (norms are 1).
        lm_head_std: that of ``lm_head`` (default ten times ``init_std``: peaked next-token distributions).
        dtype: the checkpoint dtype (recorded as the config's dtype, which sets the compute dtype for ``auto``).
        seed: initialisation seed (the same seed gives the same bytes).
        max_shard_size: passed to ``save_pretrained`` (small, so fixtures have several shards).
        overrides: config fields to change.

    Raises:
        KeyError: an unknown family (or preset).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset == "serve":
        kw = serve_config(family)
    elif preset != "tiny":
        raise KeyError(f"unknown preset {preset!r}; known: tiny, serve")
    elif family not in FAMILIES:
        raise KeyError(f"unknown example family {family!r}; known: {', '.join(FAMILIES)}")
    else:
        kw = dict(COMMON) if family != "dbrx" else dict(vocab_size=VOCAB, tie_word_embeddings=False)
        kw.update(FAMILIES[family])
    kw.update(overrides)
    head_std = 10 * init_std if lm_head_std is None else lm_head_std
    cfg = AutoConfig.for_model(family, **kw)
    if tokenizer:
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 0, 1, 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a seeded, family-independent initialisation: N(0, init_std) weights, norms at 1, and a
        gen = torch.Generator().manual_seed(seed)  # larger lm_head so that next-token distributions are peaked
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and ("norm" in name or "layernorm" in name):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (head_std if name.startswith("lm_head") else init_std))
    model = model.to(dtype)
    model.config.dtype = dtype
    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        build_tokenizer(path, vocab_size=getattr(cfg, "vocab_size", VOCAB))
    return path

"""Small, real-format MoE checkpoints made with transformers on the CPU (no download): the demo's built-in example
and the test suite's fixtures.

``build_example(family, path)`` instantiates the family's transformers model from a tiny config
(``AutoConfig.for_model`` + ``from_config``), gives it a seeded random initialisation, and writes it with
``save_pretrained`` (several shards when ``max_shard_size`` is small), plus a small byte-level BPE tokenizer.
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
                  max_shard_size: str = "200KB", tokenizer: bool = True, **overrides) -> Path:
    """Write a tiny ``family`` checkpoint (one of ``FAMILIES``) to ``path`` and return the path.

    Args:
        dtype: the checkpoint dtype (recorded as the config's dtype, which sets the compute dtype for ``auto``).
        seed: initialisation seed (the same seed gives the same bytes).
        max_shard_size: passed to ``save_pretrained`` (small, so fixtures have several shards).
        overrides: config fields to change.

    Raises:
        KeyError: an unknown family.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES:
        raise KeyError(f"unknown example family {family!r}; known: {', '.join(FAMILIES)}")
    kw = dict(COMMON) if family != "dbrx" else dict(vocab_size=VOCAB, tie_word_embeddings=False)
    kw.update(FAMILIES[family])
    kw.update(overrides)
    cfg = AutoConfig.for_model(family, **kw)
    if tokenizer:
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 0, 1, 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a seeded, family-independent initialisation: N(0, 0.05) weights, norms at 1, and a
        gen = torch.Generator().manual_seed(seed)  # larger lm_head so that next-token distributions are peaked
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and ("norm" in name or "layernorm" in name):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name.startswith("lm_head") else 0.05))
    model = model.to(dtype)
    model.config.dtype = dtype
    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        build_tokenizer(path)
    return path

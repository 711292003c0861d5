"""expq.examples' serve preset (the fixtures bench/vllm_compare.py serves with vLLM): each family's fixture loads
and runs in transformers here, carries the settings vLLM needs, and the new options leave the default bytes alone."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tree_digest
from test_goldens import GOLDENS

from expq.examples import FAMILIES, build_example

# The families bench/vllm_compare.py serves by default that transformers here instantiates (jamba, bailing_hybrid,
# qwen3_5_moe and qwen3_vl_moe are left to the script, which reports them per family).
SERVE = list(FAMILIES) + ["glm4_moe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "minimax", "qwen3_next"]


@pytest.mark.parametrize("family", SERVE)
def test_serve_preset_loads_and_runs(family, tmp_path):
    from transformers import AutoModelForCausalLM

    src = build_example(family, tmp_path / family, preset="serve", init_std=0.02, max_shard_size="50MB")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg.get("max_position_embeddings", cfg.get("max_seq_len")) >= 1024  # vLLM's max_model_len 512 fits
    assert cfg.get("hidden_size", cfg.get("d_model")) == 256
    assert cfg["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(src)
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, cfg["vocab_size"]) and torch.isfinite(logits).all()
    big = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("lm_head") and p.numel() > 4096]
    std = torch.cat([p.detach().float().flatten() for p in big]).std().item()
    assert 0.018 < std < 0.022


def test_serve_preset_family_settings(tmp_path):
    ds = json.loads((build_example("deepseek_v3", tmp_path / "ds", preset="serve") / "config.json").read_text())
    assert ds["topk_method"] == "noaux_tc" and ds["scoring_func"] == "sigmoid"  # vLLM's e_score_correction_bias
    assert ds["kv_lora_rank"] + ds["qk_rope_head_dim"] in (320, 576)  # vLLM 0.24's MLA head sizes
    assert ds["n_routed_experts"] == 8 and ds["num_experts_per_tok"] == 2
    db = json.loads((build_example("dbrx", tmp_path / "db", preset="serve") / "config.json").read_text())
    assert db["max_seq_len"] >= 1024 and db["ffn_config"]["moe_num_experts"] == 8
    go = json.loads((build_example("gpt_oss", tmp_path / "go", preset="serve") / "config.json").read_text())
    assert go["head_dim"] == 64 and go["sliding_window"] == 128


def test_unknown_preset_and_family(tmp_path):
    with pytest.raises(KeyError):
        build_example("mixtral", tmp_path / "a", preset="huge")
    with pytest.raises(KeyError):
        build_example("nosuch", tmp_path / "b", preset="serve")
    with pytest.raises(KeyError):
        build_example("glm4_moe", tmp_path / "c")  # the tiny preset still knows only FAMILIES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_bytes_unchanged(family, tmp_path):
    want = json.loads(GOLDENS.read_text())[family]["source"]
    src = build_example(family, tmp_path / "d", max_shard_size="60KB")  # as tests/helpers.example builds them
    assert tree_digest(src) == want
    explicit = build_example(family, tmp_path / "e", max_shard_size="60KB", preset="tiny", init_std=0.05)
    assert tree_digest(explicit) == want

"""One tensor-parallel rank of test_plugin_real.test_tensor_parallel (run as ``python tp_rank.py RANK SIZE PORT SRC OUT``):
builds, on this rank, the checkpoint's MoE layers with the plugin and with --quantization experts_int8, loads them
(the plugin's routing; vLLM's weight_loader with the bf16 source), processes them, and prints one JSON line: per layer
and parameter, whether the plugin's slice equals the checkpoint's and the online layer's."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_harness as h  # noqa: E402  (chooses vLLM's platform first)

rank, size, port = (int(x) for x in sys.argv[1:4])
src, out = Path(sys.argv[4]), Path(sys.argv[5])
h.start(tp_size=size, rank=rank, port=port)

import torch  # noqa: E402
from helpers import load_hf, model_expert_matrices  # noqa: E402
from test_plugin_real import checkpoint_stream, plugin_model  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from expq.engines import vllm as plugin  # noqa: E402

model, layers, ck = plugin_model(h, out)
list(plugin.routed_weights(checkpoint_stream(out), SimpleNamespace(model=str(out), dtype=torch.bfloat16), model))
config = json.loads((out / "config.json").read_text())
mats = model_expert_matrices("mixtral", load_hf(src, dtype=torch.bfloat16))
report = {}
for L, mine in layers.items():
    mine.quant_method.process_weights_after_loading(mine)
    lx = ck.layer_experts(L)
    I = lx.w2.shape[2]
    I_r = I // size
    rows = slice(rank * I_r, (rank + 1) * I_r)
    want = {"w13_weight": torch.cat([lx.w13[:, :I][:, rows], lx.w13[:, I:][:, rows]], 1),
            "w13_scale": torch.cat([lx.w13_scale[:, :I][:, rows], lx.w13_scale[:, I:][:, rows]], 1),
            "w2_weight": lx.w2[:, :, rows], "w2_scale": lx.w2_scale}
    online = h.moe_layer(config, h.online_config(), f"online.model.layers.{L}.mlp.experts")
    for e in range(online.global_num_experts):
        for proj in ("gate", "up", "down"):
            h.load_expert(online, "w2_weight" if proj == "down" else "w13_weight", mats[(L, e, proj)].clone(),
                          f"experts.{e}.{proj}.weight", proj, e)
    if not getattr(online, "_already_called_process_weights_after_loading", False):
        online.quant_method.process_weights_after_loading(online)
    theirs = dict(online.named_parameters())
    report[L] = {n: {"checkpoint": torch.equal(p.data, want[n]), "online": torch.equal(p.data, theirs[n].data)}
                 for n, p in mine.named_parameters()}
print("REPORT " + json.dumps({"rank": rank, "tp_rank": mine.moe_config.tp_rank, "layers": report}))

"""``make demo``: the main job end to end on a built-in example, with the commands a user would type.

    python -m expq.demo [WORKDIR]

1. builds a small Mixtral-architecture checkpoint with transformers (bf16, several shards, a tokenizer), with
   seeded random weights: every text it generates is gibberish, by design; what the demo shows is that the int8
   checkpoint gives the same tokens in every loader;
2. ``expq inspect`` and ``expq convert`` it;
3. ``expq verify`` the result against the source (bits, bytes, int8 fused-MoE kernel);
4. loads the result with stock transformers (experts dequantized at load) and generates a few tokens;
5. ``expq push --dry-run``: the model card and the file list a push would upload;
6. ``expq.load_model`` (experts kept int8) generates the same tokens as step 4;
7. ``expq run`` does it from the command line.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .progress import quiet_hub_bars

DEMO_CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=320)


def sh(*args: str) -> None:
    """Run an expq command as a user would (same interpreter), echoing it; stop the demo if it fails."""
    print(f"\n$ expq {' '.join(shlex.quote(a) for a in args)}", flush=True)
    r = subprocess.run([sys.executable, "-m", "expq.cli", *args])
    if r.returncode != 0:
        sys.exit(f"demo: `expq {args[0]}` exited with {r.returncode}")


def main(argv: list[str]) -> None:
    import torch

    from .examples import build_example

    work = Path(argv[0] if argv else "build/demo")
    src, out = work / "mixtral-demo", work / "mixtral-demo-int8"
    shutil.rmtree(work, ignore_errors=True)
    quiet_hub_bars()  # transformers' bars in a log: off, as in every expq command
    print(f"== 1. building a small Mixtral checkpoint with transformers in {src}", flush=True)
    print("   Its weights are random (seeded), not trained: the text it generates is gibberish, by design. What the "
          "demo shows\n   is that the int8 checkpoint verifies bit for bit and that every loader generates the "
          "same tokens.", flush=True)
    t = time.perf_counter()
    build_example("mixtral", src, dtype=torch.bfloat16, max_shard_size="10MB", **DEMO_CONFIG)
    print(f"   done in {time.perf_counter() - t:.1f} s: " + ", ".join(sorted(p.name for p in src.iterdir())))

    print("\n== 2. inspect and convert", flush=True)
    sh("inspect", str(src))
    sh("convert", str(src), str(out), "--max-shard-size", "10MB")

    print("\n== 3. verify against the source", flush=True)
    sh("verify", str(out), "--source", str(src), "--tokens", "32")

    print("\n== 4. stock transformers loads the converted checkpoint (experts dequantized at load)", flush=True)
    # greedy decoding compared in float32 (both paths): the int8 weights are the same, and fp32 activations keep the
    # kernels' different bf16 roundings from deciding near-ties between the two most likely tokens
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
    # transformers holds the experts stacked, so compressed-tensors' per-expert targets match no module and it warns
    # "Could not match ..."; harmless here (the tokens below equal expq's): see the card's transformers note
    logging.getLogger("compressed_tensors.utils.match").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(out)
    prompt = "The router picks the top-k experts"
    ids = tok(prompt, return_tensors="pt").input_ids
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        g_stock = stock.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    print(f"   transformers ({type(stock).__name__}): {g_stock[0, ids.shape[1]:].tolist()}")
    del stock

    print("\n== 5. what a push would publish (no network)", flush=True)
    print("   The WARNING lines say what a real push needs and the demo lacks: a Hub repo and a licence for the model "
          "(--base-model,\n   --license), and where readers install expq from (--install) unless this checkout "
          "has a public git remote.", flush=True)
    sh("push", str(out), "your-name/mixtral-demo-experts-int8", "--dry-run")

    print("\n== 6. expq.load_model: the same checkpoint with the experts kept int8 in memory", flush=True)
    from .runtime import experts_nbytes, load_model

    model = load_model(out, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        g_int8 = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    nb = experts_nbytes(model)
    print(f"   expq.load_model: {g_int8[0, ids.shape[1]:].tolist()} (experts {nb['experts'] / 1e6:.1f} MB int8 "
          f"+ scales; rest {nb['other'] / 1e6:.1f} MB)")
    same = torch.equal(g_stock, g_int8)
    print(f"   greedy tokens equal: {same}")
    if not same:
        sys.exit("demo: expq.load_model and transformers generated different tokens")
    print("\n== 7. expq run: the same from the command line; it prints the continuation (gibberish: random weights)",
          flush=True)
    sh("run", str(out), "--prompt", prompt, "--max-new-tokens", "12", "--device", "cpu")

    print(f"\ndemo done: source {src}, converted {out}")


if __name__ == "__main__":
    main(sys.argv[1:])

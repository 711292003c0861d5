"""Which engines load a converted checkpoint, and with which command: one answer for ``inspect``, the model card and
the README's client table.

``clients(format, layout, hidden_size)`` returns, for vLLM, transformers and expq's own loader, whether that engine
loads this family in this format, the exact command (``{model}`` stands for the repo id or directory) and why not
where it cannot. The family facts come from the layout's ``[clients]`` table and ``configs/_shared.toml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layouts import Layout, shared_facts


# Installing expq where a command needs it: here, in the environment that has expq (pip takes the installed expq and
# adds the extra's vLLM); the model card replaces it by the line its readers can run (hub.install_line).
INSTALL_HERE = 'pip install "expq[vllm]"'


@dataclass(frozen=True)
class Client:
    """One engine's answer. ``language`` is ``bash`` or ``python`` (the command's code-block language); ``command``
    is None where the engine cannot load the checkpoint (``note`` says why)."""

    engine: str
    loads: bool
    language: str
    command: str | None
    note: str = ""

    def for_model(self, model: str, install: str = INSTALL_HERE) -> str | None:
        """The command with ``{model}`` filled in, and ``{install}`` (installing expq, where the command needs it)
        by ``install``: by default the line for an environment that already has expq (the model card passes the
        line its readers run)."""
        if self.command is None:
            return None
        return self.command.replace("{model}", model).replace("{install}", install)

    def one_line(self, model: str) -> str | None:
        """The command on one line, comments dropped (``&&`` between shell commands, ``;`` between statements)."""
        if self.command is None:
            return None
        lines = [ln.split("  #")[0].rstrip() for ln in self.for_model(model).splitlines()]
        return (" && " if self.language == "bash" else "; ").join(ln for ln in lines if ln)


VLLM_PLUGIN = '{install}  # expq\'s vLLM plugin (an entry point vLLM loads by itself)\nvllm serve {model}'
TRANSFORMERS_EXPQ = ('import expq  # registers expq\'s transformers quantizer\n'
                     'from transformers import AutoModelForCausalLM\n'
                     'model = AutoModelForCausalLM.from_pretrained("{model}")  # experts stay int8 (expq\'s kernel)')
TRANSFORMERS_STOCK = ('from transformers import AutoModelForCausalLM\n'
                      'model = AutoModelForCausalLM.from_pretrained("{model}")  # experts dequantized to 16-bit at load')
# transformers 5 holds a family's experts stacked (one module per layer), so the per-expert module targets of the
# compressed-tensors config match no module and compressed-tensors logs a warning; transformers' own weight conversion
# still loads the per-expert tensors into the stacked experts (tests/test_convert.py compares the logits).
CT_MATCH_WARNING = ("transformers may log compressed-tensors' warning `Could not match ... in instance of ...` for "
                    "the experts' targets: it is harmless. transformers holds the experts stacked, one module per "
                    "layer, so the per-expert targets match no module; its own weight conversion loads the "
                    "per-expert tensors into them.")
EXPQ = ('import expq\nfrom huggingface_hub import snapshot_download\n'
        'model = expq.load_model(snapshot_download("{model}"))  # int8 experts, fused-MoE kernel')
EXPQ_LOCAL = 'import expq\nmodel = expq.load_model("{model}")  # a local directory: int8 experts, fused-MoE kernel'


def clients(fmt: str, layout: Layout, hidden_size: int | None, *, local: bool = False) -> list[Client]:
    """vLLM, transformers and expq for checkpoints of ``layout``'s family in output format ``fmt``.

    Args:
        fmt: ``compressed-tensors`` or ``experts-int8``.
        hidden_size: the model's (Marlin needs a multiple of 128 for compressed-tensors), or None if unknown.
        local: the model is a local directory (expq's command then needs no download).
    """
    expq = Client("expq", True, "python", EXPQ_LOCAL if local else EXPQ)
    if fmt == "experts-int8":
        vllm = Client("vLLM", False, "bash", None, f"expq's vLLM plugin cannot serve this family: "
                      f"{layout.vllm_plugin}") if layout.vllm_plugin else None
        return [vllm or Client("vLLM", True, "bash", VLLM_PLUGIN,
                       "expq's plugin loads the int8 codes and fp32 scales as they are and runs vLLM's own int8 "
                       "W8A16 fused-MoE kernel, the one `--quantization experts_int8` runs; stock vLLM without the "
                       "plugin refuses the checkpoint (unknown quantization method)."),
                Client("transformers", True, "python", TRANSFORMERS_EXPQ,
                       "stock transformers without `import expq` refuses it (a size-mismatch error on the layer "
                       "markers), never a model with random experts."),
                expq]
    advice = shared_facts().vllm
    instead = ("; use `--format experts-int8` and expq's plugin" if not layout.vllm_plugin else
               f" (nor through expq's plugin: {layout.vllm_plugin})")
    if layout.stock_vllm:
        vllm = Client("vLLM", False, "bash", None, f"stock vLLM cannot serve this family in this format: "
                      f"{layout.stock_vllm}{instead}")
    elif hidden_size and hidden_size % advice.marlin_hidden_multiple:
        vllm = Client("vLLM", False, "bash", None, f"vLLM runs this format through Marlin, which needs the hidden "
                      f"size to be a multiple of {advice.marlin_hidden_multiple}; this model's is {hidden_size}"
                      + instead.replace("; use", ", so use"))
    else:
        note = (f"vLLM runs the experts through its W8A16 MoE path (Marlin). {advice.backend_note} "
                f"{advice.tp_scales_note} {advice.rocm_note}")
        vllm = Client("vLLM", True, "bash", "vllm serve {model}",
                      note + (f" Note: {layout.vllm_note}." if layout.vllm_note else ""))
    if layout.stock_transformers:
        tf = Client("transformers", True, "python", TRANSFORMERS_STOCK, CT_MATCH_WARNING)
    else:
        tf = Client("transformers", False, "python", None,
                    "stock transformers cannot map per-expert compressed tensors onto this family's stacked experts "
                    "(it would leave them randomly initialised); use `--format experts-int8` or expq.load_model")
    return [vllm, tf, expq]


def stock_transformers_misloads(fmt, layout: Layout) -> str:
    """Why stock transformers (without expq) would load a checkpoint of ``layout``'s family in format ``fmt`` with
    randomly initialised routed experts, or ``""`` when it would not (it loads them right, or refuses the format).

    Args:
        fmt: a ``formats.Format`` (or its class): whether stock transformers reads the format at all.
        layout: the family; its ``[clients] transformers`` says whether stock transformers maps the format's
            per-expert tensors onto the family's experts.
    """
    if not fmt.stock_transformers_loads or layout.stock_transformers:
        return ""
    return (f"stock transformers loads {fmt.name} checkpoints of the {layout.name} family with randomly initialised "
            "routed experts, without an error (it has no conversion from per-expert quantized tensors to this "
            "family's stacked experts: the layout's [clients] transformers = false)")

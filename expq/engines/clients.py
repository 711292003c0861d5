"""Which engines load a converted checkpoint, and with which command: one answer for ``inspect``, the model card and
the README's client table.

A format's ``clients(layout, hidden_size)`` (``formats.base.Format``) returns, for vLLM, SGLang, transformers and
expq's own loader, whether that engine loads this family in this format, the exact command (``{model}`` stands for
the repo id or directory) and why not where it cannot; it builds them with ``expq_clients`` (a format only expq
loads) or ``stock_w8a16_clients`` (the W8A16 format stock engines load) below. The family facts come from the layout's ``[clients]`` table and ``configs/_shared.toml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats import FORMATS, Format
from ..layouts import Layout, shared_facts
from .vllm_compat import TESTED_RANGE

TESTED = {"vLLM": "-".join(TESTED_RANGE), "SGLang": "0.5.23"}
"""The engine releases the compressed-tensors output and expq's vLLM plugin are tested with (``make test-vllm``:
vLLM 0.24, 0.29 and 0.33 on a CPU, 0.24 served on an H200; SGLang's classes on a CPU)."""

# vLLM 0.32-0.33 rank Humming above Marlin for WNA16 MoE on SM90, and their compressed-tensors WNA16 method then
# asserts strategy == "group": the channel-wise output needs `--moe-backend marlin` there (every vLLM from 0.24 on
# accepts the flag and runs the same Marlin kernel with it). tests/vllm_real checks this against the real releases.
MARLIN_FLAG_VERSIONS = ("0.32", "0.33")
MARLIN_FLAG_COMPUTE_CAPABILITIES = (90,)
MARLIN_FLAG = "--moe-backend marlin"


def vllm_needs_marlin_flag(version: str, compute_capability: int) -> bool:
    """Whether stock vLLM ``version`` ("0.33.0") on a GPU of ``compute_capability`` (90 = H100/H200) needs
    ``--moe-backend marlin`` to serve the compressed-tensors output (W8A16 channel-wise)."""
    line = ".".join(version.split(".")[:2])
    return line in MARLIN_FLAG_VERSIONS and compute_capability in MARLIN_FLAG_COMPUTE_CAPABILITIES


def vllm_ct_commands() -> tuple[tuple[str, str], ...]:
    """(which vLLM and GPU, the command) for serving the compressed-tensors output with stock vLLM."""
    lines = f"{MARLIN_FLAG_VERSIONS[0]}-{MARLIN_FLAG_VERSIONS[-1]}"
    major, minor = MARLIN_FLAG_VERSIONS[0].split(".")
    before = f"{TESTED_RANGE[0]}-{major}.{int(minor) - 1}"
    return ((f"vLLM {before} on any NVIDIA GPU; vLLM {lines} on A100, L40S, B200 and other GPUs that are not SM90",
             "vllm serve {model}"),
            (f"vLLM {lines} on H100, H200, H20, GH200 (SM90); this command serves on every vLLM {TESTED['vLLM']}",
             f"vllm serve {{model}} {MARLIN_FLAG}"))


# Installing expq where a command needs it: here, in the environment that has expq (pip takes the installed expq and
# adds the extra's vLLM); the model card replaces it by the line its readers can run (hub.install_line).
INSTALL_HERE = 'pip install "expq[vllm]"'


@dataclass(frozen=True)
class Client:
    """One engine's answer. ``language`` is ``bash`` or ``python`` (the command's code-block language); ``command``
    is None where the engine cannot load the checkpoint (``note`` says why); ``variants``: the exact command per
    engine version and GPU class where one command does not fit all."""

    engine: str
    loads: bool
    language: str
    command: str | None
    note: str = ""
    variants: tuple[tuple[str, str], ...] = ()  # (which version / GPU, the exact command) where they differ

    def for_model(self, model: str, install: str = INSTALL_HERE) -> str | None:
        """The command with ``{model}`` filled in, and ``{install}`` (installing expq, where the command needs it)
        by ``install``: by default the line for an environment that already has expq (the model card passes the
        line its readers run)."""
        if self.command is None:
            return None
        return self.command.replace("{model}", model).replace("{install}", install)

    def variant_lines(self, model: str) -> list[tuple[str, str]]:
        """``variants`` with ``{model}`` filled in."""
        return [(when, cmd.replace("{model}", model)) for when, cmd in self.variants]

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
SGLANG = "python -m sglang.launch_server --model-path {model}"
SGLANG_ACTIVATIONS = ("silu",)  # SGLang's compressed-tensors WNA16 MoE (Marlin) asserts SiLU
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


def expq_clients(fmt: Format, layout: Layout, hidden_size: int | None, *, local: bool = False,
                 vllm_plugin: bool = False) -> list[Client]:
    """vLLM, SGLang, transformers and expq for a format only expq loads (``fmt.expq_loads``): vLLM through expq's
    plugin where ``vllm_plugin`` (the plugin serves the format) and the family allows it, transformers after
    ``import expq``, never SGLang.

    Args:
        hidden_size: the model's, or None if unknown (unused: no kernel here asks for a multiple).
        local: the model is a local directory (expq's command then needs no download).
    """
    if not vllm_plugin:
        vllm = Client("vLLM", False, "bash", None, f"expq's vLLM plugin does not serve the {fmt.name} format; "
                      f"convert with {_formats(expq_loads=False)} for stock vLLM")
    elif layout.vllm_plugin:
        vllm = Client("vLLM", False, "bash", None, f"expq's vLLM plugin cannot serve this family: "
                      f"{layout.vllm_plugin}")
    else:
        vllm = Client("vLLM", True, "bash", VLLM_PLUGIN,
                      "expq's plugin loads the int8 codes and fp32 scales as they are and runs vLLM's own int8 "
                      "W8A16 fused-MoE kernel, the one `--quantization experts_int8` runs (`EXPQ_VLLM_KERNEL=expq` "
                      "runs expq's fused-MoE kernel instead); stock vLLM without the "
                      "plugin refuses the checkpoint (unknown quantization method).")
    return [vllm,
            Client("SGLang", False, "bash", None, f"SGLang has no loader for expq's {fmt.name} format; convert "
                   f"with {_formats(expq_loads=False)} for SGLang"),
            Client("transformers", True, "python", TRANSFORMERS_EXPQ,
                   "stock transformers without `import expq` refuses it (a size-mismatch error on the layer "
                   "markers), never a model with random experts."),
            Client("expq", True, "python", EXPQ_LOCAL if local else EXPQ)]


def stock_w8a16_clients(fmt: Format, layout: Layout, hidden_size: int | None, *,
                        local: bool = False) -> list[Client]:
    """vLLM, SGLang, transformers and expq for a W8A16 channel-wise format stock engines load themselves: vLLM and
    SGLang through their WNA16 MoE (Marlin), stock transformers where the family's layout allows it, and expq.

    Args:
        hidden_size: the model's (Marlin needs a multiple of 128), or None if unknown.
        local: the model is a local directory (expq's command then needs no download).
    """
    advice = shared_facts().vllm
    expq_formats = _formats(expq_loads=True)
    instead = (f"; use {expq_formats} and expq's plugin" if not layout.vllm_plugin else
               f" (nor through expq's plugin: {layout.vllm_plugin})")
    if layout.stock_vllm:
        vllm = Client("vLLM", False, "bash", None, f"stock vLLM cannot serve this family in this format: "
                      f"{layout.stock_vllm}{instead}")
    elif hidden_size and hidden_size % advice.marlin_hidden_multiple:
        vllm = Client("vLLM", False, "bash", None, f"vLLM runs this format through Marlin, which needs the hidden "
                      f"size to be a multiple of {advice.marlin_hidden_multiple}; this model's is {hidden_size}"
                      + instead.replace("; use", ", so use"))
    else:
        note = (f"vLLM runs the experts through its W8A16 MoE path (Marlin); tested with vLLM {TESTED['vLLM']}. "
                f"{advice.tp_scales_note} {advice.rocm_note}")
        vllm = Client("vLLM", True, "bash", "vllm serve {model}",
                      note + (f" Note: {layout.vllm_note}." if layout.vllm_note else ""), vllm_ct_commands())
    if layout.stock_transformers:
        tf = Client("transformers", True, "python", TRANSFORMERS_STOCK, CT_MATCH_WARNING)
    else:
        tf = Client("transformers", False, "python", None,
                    "stock transformers cannot map per-expert compressed tensors onto this family's stacked experts "
                    f"(it would leave them randomly initialised); use {expq_formats} or expq.load_model")
    return [vllm, sglang(layout, hidden_size), tf, Client("expq", True, "python", EXPQ_LOCAL if local else EXPQ)]


def _formats(*, expq_loads: bool) -> str:
    """The ``--format`` options of the registered formats that only expq loads, or that stock engines load."""
    return " or ".join(f"`--format {name}`" for name, cls in FORMATS.items() if cls.expq_loads == expq_loads)


def sglang(layout: Layout, hidden_size: int | None) -> Client:
    """SGLang (``TESTED["SGLang"]``) for the W8A16 format stock engines load: through its Marlin MoE, SiLU families
    that stock vLLM's loaders serve too (SGLang looks experts up by the same per-expert names)."""
    multiple = shared_facts().vllm.marlin_hidden_multiple
    why = (f"its compressed-tensors MoE (Marlin) runs SiLU only and this family's activation is {layout.activation}"
           if layout.activation not in SGLANG_ACTIVATIONS else
           f"as stock vLLM, it cannot: {layout.stock_vllm}" if layout.stock_vllm else
           f"Marlin needs the hidden size to be a multiple of {multiple}; this model's is {hidden_size}"
           if hidden_size and hidden_size % multiple else "")
    if why:
        return Client("SGLang", False, "bash", None, f"SGLang cannot serve this checkpoint: {why}")
    return Client("SGLang", True, "bash", SGLANG,
                  f"SGLang {TESTED['SGLang']} runs the experts through its compressed-tensors WNA16 MoE "
                  "(`fused_marlin_moe`, SiLU only) on NVIDIA GPUs; expq's tests load this format into SGLang's own "
                  "MoE layer (on a CPU), they do not serve it on a GPU yet.")


def stock_transformers_misloads(fmt, layout: Layout) -> str:
    """Why stock transformers (without expq) would load a checkpoint of ``layout``'s family in format ``fmt`` with
    randomly initialised routed experts, or ``""`` when it would not (it loads them right, or refuses the format).

    Args:
        fmt: a ``formats.Format`` (or its class): whether stock transformers reads the format at all.
        layout: the family; its ``[clients] transformers`` says whether stock transformers maps the format's
            per-expert tensors onto the family's experts.
    """
    if fmt.expq_loads or layout.stock_transformers:
        return ""
    return (f"stock transformers loads {fmt.name} checkpoints of the {layout.name} family with randomly initialised "
            "routed experts, without an error (it has no conversion from per-expert quantized tensors to this "
            "family's stacked experts: the layout's [clients] transformers = false)")

"""What one decoder layer saves for backward: eager, compiled, compiled under memory budgets.

One transformers ``LlamaDecoderLayer`` of the SFT-step model (hidden 2048, 32 heads / 8 KV
heads, intermediate 8192; ``--quick``: the tiny one) runs a forward on [B, S, H] hidden states
that require grad, as inside the model (position embeddings given, no mask: causal SDPA, as the
recipe's CausalFastPath runs it). Every tensor autograd saves for the backward passes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook; compiled layers save theirs through the
same hook (AOTAutograd's ``save_for_backward``; the script checks the count against the
compiled backward node's ``saved_tensors``). Saved tensors are told apart by storage:

- parameters (not activations: FSDP2 decides how long the unsharded ones live);
- cos/sin of the rotary embedding (computed once per forward, shared by all layers);
- activations: the layer's input and everything computed in it. Each storage counts once,
  whole (a view keeps its whole storage alive).

Each activation is named by comparing its values with the eager layer's intermediates (the
norms' fp32 upcasts and rstd, q/k/v before and after RoPE, the attention output and its
logsumexp, the MLP's gate, up and product, ...). On CUDA the allocator's growth over the
forward, less the output, is a second, independent measure ("allocator bytes/token"): of the
activations computed in the layer, so the layer input (allocated before, 2*H bytes a token in
bf16) is not in it.

Variants: ``eager``; ``compiled`` (``train_recipes.model.build.compile_decoder_layers`` as the
recipe calls it: inductor); ``budget=<b>`` (the same with ``memory_budget=b``, the recipe's
``model.compile_memory_budget``); ``aggressive`` (functorch's ``aggressive_recomputation``);
``liger`` (CUDA only: Liger-Kernel's RMSNorm/SwiGLU/RoPE patched into the eager layer; runs
last, the patches stay).

    python packages/recipes/bench/saved_activations.py --device cpu --list
    python packages/recipes/bench/saved_activations.py --device cuda --seq 4096 --out saved.json
    python packages/recipes/bench/saved_activations.py --quick     # tiny layer (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from train_recipes.model.attention import sdpa_backends
from train_recipes.model.build import compile_decoder_layers
from train_testing.bench import (
    LLAMA_1P5B,
    LLAMA_TINY,
    add_device_argument,
    device_name,
    fmt,
    print_lines,
    print_table,
    versions,
    write_json,
)

DEFAULT_VARIANTS = "eager,compiled,budget=0.9,budget=0.8,budget=0.7,budget=0.6,budget=0.5"


@dataclass(kw_only=True, slots=True)
class Saved:
    """One tensor saved for backward."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  # "activation", "parameter" or "rope"
    bytes: int  # its storage's bytes; 0 when an earlier saved tensor holds the same storage
    name: str  # what it is (the eager intermediate it equals), "?" when none matches


def build_layer(args: argparse.Namespace) -> nn.Module:
    """A one-layer LlamaForCausalLM of the benchmark's dims (a small vocabulary: only the layer
    runs), seeded so that every variant gets the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(LLAMA_TINY if args.quick else LLAMA_1P5B)
    dims.update(num_hidden_layers=1, vocab_size=256)
    config = LlamaConfig(
        **dims,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # RMSNorm weights start at 1, where a norm's output equals its normalised input: make
        # them differ so that the saved tensors are told apart by value.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model.to(device=args.device, dtype=args.dtype).train()


def layer_inputs(model: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """The layer's inputs: hidden [B, S, H] (requires grad), position ids, (cos, sin)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.batch, args.seq, model.config.hidden_size, generator=g)
    hidden = hidden.to(device=args.device, dtype=args.dtype)
    positions = torch.arange(args.seq, device=args.device).expand(args.batch, -1)
    cos, sin = model.model.rotary_emb(hidden, positions)
    return {"hidden": hidden, "position_ids": positions, "cos": cos, "sin": sin}


def run_layer(layer: nn.Module, inputs: dict[str, Any], hidden: Tensor) -> Tensor:
    out: Tensor = layer(
        hidden,
        attention_mask=None,
        position_ids=inputs["position_ids"],
        position_embeddings=(inputs["cos"], inputs["sin"]),
    )
    return out


def reference_intermediates(layer: nn.Module, inputs: dict[str, Any]) -> list[tuple[str, Tensor]]:
    """The eager layer's intermediates, each in the layouts a saved tensor may take."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    caught: dict[str, Tensor] = {}

    def keep(name: str, what: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            caught[name] = (args[0] if what == "in" else out).detach()

        return hook

    attn, mlp = layer.self_attn, layer.mlp
    modules = {
        "norm 1 output": (layer.input_layernorm, "out"),
        "q_proj output": (attn.q_proj, "out"),
        "k_proj output": (attn.k_proj, "out"),
        "v_proj output": (attn.v_proj, "out"),
        "attention output (o_proj input)": (attn.o_proj, "in"),
        "o_proj output": (attn.o_proj, "out"),
        "residual after attention (norm 2 input)": (layer.post_attention_layernorm, "in"),
        "norm 2 output": (layer.post_attention_layernorm, "out"),
        "gate_proj output": (mlp.gate_proj, "out"),
        "up_proj output": (mlp.up_proj, "out"),
        "silu(gate)": (mlp.act_fn, "out"),
        "silu(gate) * up (down_proj input)": (mlp.down_proj, "in"),
        "down_proj output": (mlp.down_proj, "out"),
    }
    handles = [m.register_forward_hook(keep(n, w)) for n, (m, w) in modules.items()]
    try:
        with torch.no_grad():
            out = run_layer(layer, inputs, inputs["hidden"])
    finally:
        for h in handles:
            h.remove()
    b, s, _ = inputs["hidden"].shape
    heads, kv_heads, d = (
        attn.config.num_attention_heads,
        attn.config.num_key_value_heads,
        attn.head_dim,
    )

    def per_head(t: Tensor, n: int) -> Tensor:  # [B, S, n*D] -> [B, n, S, D]
        return t.view(b, s, n, d).transpose(1, 2)

    q, k = per_head(caught["q_proj output"], heads), per_head(caught["k_proj output"], kv_heads)
    q_rope, k_rope = apply_rotary_pos_emb(q, k, inputs["cos"], inputs["sin"])
    refs = [("layer input", inputs["hidden"]), ("layer output", out.detach())]
    for i, (x, norm) in enumerate(
        [
            (inputs["hidden"], layer.input_layernorm),
            (caught[_NORM2_IN], layer.post_attention_layernorm),
        ]
    ):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        refs += [
            (f"norm {i + 1} input, fp32 upcast", x32),
            (f"norm {i + 1} rstd (fp32)", rstd),
            (f"norm {i + 1} input * rstd (fp32)", x32 * rstd),
            (f"norm {i + 1} input * rstd, cast back", (x32 * rstd).to(x.dtype)),
        ]
    refs += list(caught.items())
    refs += [
        ("q after RoPE", q_rope),
        ("k after RoPE", k_rope),
        ("q (per head, before RoPE)", q),
        ("k (per head, before RoPE)", k),
        ("v (per head)", per_head(caught["v_proj output"], kv_heads)),
        ("attention output (per head)", per_head(caught["attention output (o_proj input)"], heads)),
        ("attention logsumexp (fp32)", _causal_logsumexp(q_rope, k_rope, attn.scaling)),
    ]
    return refs


_NORM2_IN = "residual after attention (norm 2 input)"


def _causal_logsumexp(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """[B, h, S] logsumexp of the causal attention scores (what flash-style kernels save)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    out = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    for start in range(0, q.shape[2], 1024):  # row blocks: [B, h, 1024, S] at most
        rows = slice(start, start + 1024)
        scores = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) * scale
        idx = torch.arange(q.shape[2], device=q.device)
        scores.masked_fill_(idx[None, :] > idx[rows, None], -math.inf)
        out[:, :, rows] = scores.logsumexp(-1)
    return out


def name_of(t: Tensor, refs: list[tuple[str, Tensor]]) -> str:
    """The reference with the same dtype, element count and values (max error < 2% of its max)."""
    best, best_err = "?", 0.02
    for name, ref in refs:
        if ref.dtype != t.dtype or ref.numel() != t.numel():
            continue
        a, b = t.detach().float().reshape(-1), ref.reshape(t.shape).float().reshape(-1)
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        if err < best_err:
            best, best_err = name, err
    return best


@contextlib.contextmanager
def collect(saved: list[Tensor]) -> Iterator[None]:
    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def measure(
    model: nn.Module,
    inputs: dict[str, Any],
    refs: list[tuple[str, Tensor]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Warm up (compile) with a forward and backward, then list what a second forward saves."""
    layer = model.model.layers[0]
    for _ in range(2):
        hidden = inputs["hidden"].detach().requires_grad_(True)
        run_layer(layer, inputs, hidden).float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    hidden = inputs["hidden"].detach().requires_grad_(True)
    tensors: list[Tensor] = []
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with collect(tensors):
        out = run_layer(layer, inputs, hidden)
    held = None
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    compiled_node = out.grad_fn
    while compiled_node is not None and "CompiledFunction" not in type(compiled_node).__name__:
        nexts = [f for f, _ in compiled_node.next_functions if f is not None]
        compiled_node = nexts[0] if len(nexts) == 1 else None
    if compiled_node is not None:
        # The hook must have seen every tensor the compiled function saved.
        n = len(compiled_node.saved_tensors)
        assert n == len(tensors), f"hooks saw {len(tensors)} tensors, the compiled node holds {n}"
    rows = classify(tensors, model, inputs, refs)
    tokens = args.batch * args.seq
    act = sum(r.bytes for r in rows if r.kind == "activation")
    out.float().square().mean().backward()  # the saved tensors were enough for a backward
    return {
        "saved tensors": len(rows),
        "activations": sum(r.kind == "activation" for r in rows),
        "activation bytes/token": act / tokens,
        "allocator bytes/token": None if held is None else held / tokens,
        "compiled node": compiled_node is not None,
        "saved": [
            {
                "shape": r.shape,
                "dtype": r.dtype,
                "kind": r.kind,
                "bytes/token": r.bytes / tokens,
                "name": r.name,
            }
            for r in rows
        ],
    }


def classify(
    tensors: list[Tensor], model: nn.Module, inputs: dict[str, Any], refs: list[tuple[str, Tensor]]
) -> list[Saved]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    rope = {inputs["cos"].untyped_storage().data_ptr(), inputs["sin"].untyped_storage().data_ptr()}
    seen: set[int] = set()
    rows = []
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        kind = "parameter" if ptr in params else "rope" if ptr in rope else "activation"
        first = ptr not in seen
        seen.add(ptr)
        rows.append(
            Saved(
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                kind=kind,
                bytes=storage.nbytes() if first else 0,
                name=name_of(t, refs) if kind == "activation" else "",
            )
        )
    return rows


def prepare(
    variant: str, args: argparse.Namespace
) -> tuple[nn.Module, contextlib.AbstractContextManager[Any]]:
    """The model of ``variant`` and the context its first (compiling) call runs in."""
    torch._dynamo.reset()  # every compiled variant traces anew
    if variant == "liger":
        if args.device != "cuda":
            raise ValueError("the liger variant needs CUDA (Liger-Kernel's kernels are Triton)")
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(cross_entropy=False, fused_linear_cross_entropy=False)
    model = build_layer(args)
    ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if variant == "compiled":
        compile_decoder_layers(model, backend=args.backend)
    elif variant.startswith("budget="):
        compile_decoder_layers(
            model, backend=args.backend, memory_budget=float(variant.split("=")[1])
        )
    elif variant == "aggressive":
        import torch._functorch.config as functorch_config

        compile_decoder_layers(model, backend=args.backend)
        ctx = functorch_config.patch(aggressive_recomputation=True)
    elif variant not in ("eager", "liger"):
        raise ValueError(f"unknown variant {variant!r}; see the module docstring")
    return model, ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend (default: inductor; with --quick aot_eager_decomp_partition, "
        "which partitions the same way without generating code)",
    )
    parser.add_argument(
        "--sdpa",
        default=None,
        help="SDPA backend order, as sft_step.py's recipes step (default: cudnn,flash on CUDA, "
        "torch's choice on the CPU)",
    )
    parser.add_argument("--list", action="store_true", help="print every saved tensor")
    parser.add_argument("--quick", action="store_true", help="the tiny layer (CI)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.backend is None:
        args.backend = "aot_eager_decomp_partition" if args.quick else "inductor"
    if args.quick:
        args.seq = min(args.seq, 64)
    if args.sdpa is None:
        args.sdpa = "cudnn,flash" if args.device == "cuda" else ""
    backends = tuple(args.sdpa.split(",")) if args.sdpa else None
    names = args.variants.split(",")
    names.sort(key=lambda v: v == "liger")  # its patches stay: after every other variant
    eager_model = build_layer(args)
    inputs = layer_inputs(eager_model, args)
    refs = reference_intermediates(eager_model.model.layers[0], inputs)
    del eager_model
    rows = []
    for variant in names:
        model, ctx = prepare(variant, args)
        with ctx, sdpa_backends(backends):
            row = {"variant": variant, **measure(model, inputs, refs, args)}
        rows.append(row)
        if args.list:
            print_saved(row)
    base = {r["variant"]: r["activation bytes/token"] for r in rows}
    columns = [
        "variant",
        "saved tensors",
        "activations",
        "activation bytes/token",
        "allocator bytes/token",
    ]
    for r in rows:
        for ref in ("eager", "compiled"):
            if ref in base:
                r[f"vs {ref}"] = r["activation bytes/token"] / base[ref]
    extra = [f"vs {ref}" for ref in ("eager", "compiled") if ref in base]
    title = (
        f"saved for backward by one decoder layer, batch {args.batch} x {args.seq}, "
        f"{str(args.dtype).removeprefix('torch.')}, {device_name(args.device)}"
    )
    print_table(rows, columns + extra, title=title, cell=_cell)
    if args.out:
        meta = {
            **versions(),
            "device_name": device_name(args.device),
            "batch": args.batch,
            "seq": args.seq,
            "sdpa": args.sdpa,
        }
        write_json(
            args.out,
            {"meta": {**meta, "dtype": str(args.dtype), "quick": args.quick}, "rows": rows},
        )


def _cell(value: Any) -> str:
    """Byte counts as whole numbers (75,912), ratios to 4 significant digits."""
    if isinstance(value, float) and abs(value) >= 100:
        return f"{value:,.0f}"
    return fmt(value)


def print_saved(row: dict[str, Any]) -> None:
    """Every saved tensor of one variant but the parameters, in the order they were saved."""
    total = _cell(row["activation bytes/token"])
    lines = ["", f"{row['variant']}: {total} activation bytes/token"]
    for s in row["saved"]:
        if s["kind"] == "parameter":
            continue
        shared = s["kind"] == "activation" and not s["bytes/token"]
        name = s["name"] + (" (same storage as above)" if shared else "")
        size = f"{_cell(s['bytes/token']):>7} B/token"
        lines.append(f"  {s['kind']:10} {s['shape']!s:22} {s['dtype']:9} {size}  {name}")
    print_lines(*lines)


if __name__ == "__main__":
    main()

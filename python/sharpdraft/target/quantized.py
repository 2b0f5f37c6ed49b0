"""The target's linear layers on GGUF block-quantised weights (`QuantLinear`), read from the GGUF
file itself or re-quantised at load, and the measured rule behind `--weights auto`.

A decode step of a small model on a CPU streams every weight from memory: float32 weights read
538 MB a forward for SmolLM2-135M, its Q4_1 blocks 84 MB. `QuantLinear` keeps the blocks
(`sharpdraft_ext.cpu_runtime.quant_pack`) and multiplies int8-quantised activations with them
(`quant_linear`, integer dot products) for up to QUANT_MAX_ROWS rows: every decode and
verification step, always through that one kernel, so a row's result never depends on how many
rows share the call (the lossless engine needs it). Past that (a long prompt's prefill) it runs
F.linear on the float32 weight the blocks hold, which the GEMM does faster.

The quantised model is a different model from the float32 one (int8 activations, and for
re-quantised formats coarser weights): its greedy agreement and perplexity against the float32
model are measured in benchmarks/results/quant-cpu.

Formats: Q4_0, Q4_1, Q8_0 (GGML's, as gguf-py reads them). Supported GGUF architectures: those
transformers maps to a Llama-style decoder (llama, whose q / k rows the GGUF converter permuted
for its rotary layout, and qwen2 / qwen3, which it did not).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from sharpdraft_ext import cpu_runtime
from torch import nn

from .linears import interleaved_medians, linear_paths, pack_weight, paths_for, run_path

QTYPES = cpu_runtime.QTYPES
# Rows up to this many (a decode step, a verification, a wide tree's) always take the
# quantised kernel; a prefill past it takes F.linear on the dequantised weight.
QUANT_MAX_ROWS = 96
# What `--weights` accepts: the GGUF file's own blocks, a format re-quantised from the float
# weights at load, or dense weights of a dtype ("auto" chooses between gguf and dense).
WEIGHTS = ("auto", "gguf", "q8_0", "q4_0", "q4_1", "float32", "bfloat16")

_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PERMUTED_QK = {"llama": True, "qwen2": False, "qwen3": False}


class QuantLinear(nn.Module):
    """A linear layer on quantised blocks (forward only; no gradient reaches its weight).

    Attributes: `qtype`; `packed` (uint8, this machine's layout); `weight`, the float32 weight
    the blocks hold (a frozen parameter, for prefills and for code that reads `.weight`);
    `bias` (the wrapped layer's, or None).

    Args:
        linear: the `nn.Linear` it replaces (its bias is kept, its weight is not read).
        blocks: uint8 (out_features, in_features / 32 * block bytes), GGUF block layout.
        qtype: "q4_0", "q4_1" or "q8_0".

    Raises:
        ValueError naming the argument: blocks that do not fit the layer's shape and qtype.
    """

    def __init__(self, linear: nn.Linear, blocks: torch.Tensor, qtype: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qtype = qtype
        self.packed = cpu_runtime.quant_pack(blocks, qtype, self.out_features, self.in_features)
        self.weight = nn.Parameter(cpu_runtime.quant_unpack(self.packed, qtype, self.out_features),
                                   requires_grad=False)
        self.bias = linear.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if (x.device.type != "cpu" or x.dtype != torch.float32 or rows > QUANT_MAX_ROWS
                or rows == 0 or (torch.is_grad_enabled() and x.requires_grad)):
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.sharpdraft_cpu_runtime.quant_linear(x, self.packed, self.qtype,
                                                             self.out_features, bias)


def is_quantised(model: nn.Module) -> bool:
    """Whether any linear layer of `model` runs on quantised blocks (`QuantLinear`)."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


def _gguf_reader(path: Path):
    """gguf-py's reader over `path`, or a one-line error naming the file (a truncated or
    corrupt GGUF)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for t in reader.tensors:   # the reader maps lazily: check every tensor lies in the file
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} ends past the end of the file")
    except Exception as err:
        raise ValueError(f"{path}: not a complete GGUF file ({type(err).__name__}: {err}); "
                         f"download or copy it again") from err
    return reader


def check_gguf(path: Path) -> None:
    """Raise a one-line ValueError naming `path` when it is not a complete GGUF file (bad magic,
    truncated header or tensor data)."""
    _gguf_reader(Path(path))


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if v.dtype == np.uint8 else v.item()


def gguf_blocks(path: Path) -> Dict[str, Tuple[torch.Tensor, str]]:
    """{transformers module name: (uint8 blocks, qtype)} of the GGUF file's linear weights in
    Q4_0, Q4_1 or Q8_0, rows in transformers' order (llama's q / k un-permuted as transformers
    does when it dequantises the file); the LM head from `output.weight`, or the tied token
    embedding. Weights in other formats are left out (they stay dense).

    Raises:
        ValueError naming the file: not a complete GGUF, or an architecture outside
        `_PERMUTED_QK`.
    """
    reader = _gguf_reader(Path(path))
    arch = _field(reader, "general.architecture")
    if arch not in _PERMUTED_QK:
        raise ValueError(f"{path}: GGUF architecture {arch!r}: quantised weights support "
                         f"{', '.join(_PERMUTED_QK)} (use --weights float32)")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if name == "output.weight":
            hf = "lm_head"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            hf = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        else:
            continue
        qtype = t.tensor_type.name.lower()
        if qtype not in QTYPES:
            continue
        blocks = np.asarray(t.data)
        if _PERMUTED_QK[arch] and parts[-2] in ("attn_q", "attn_k"):
            n = blocks.shape[0]
            h = heads if parts[-2] == "attn_q" else kv_heads
            blocks = blocks[np.arange(n).reshape(h, n // h // 2, 2).swapaxes(1, 2).reshape(-1)]
        out[hf] = (torch.from_numpy(np.array(blocks)), qtype)    # a copy: the file is mapped
    if "lm_head" not in out and "token_embd.weight" in tensors:
        t = tensors["token_embd.weight"]
        if t.tensor_type.name.lower() in QTYPES:
            out["lm_head"] = (torch.from_numpy(np.array(t.data)),
                              t.tensor_type.name.lower())
    return out


def requantised_blocks(model: nn.Module, qtype: str) -> Dict[str, Tuple[torch.Tensor, str]]:
    """{module name: (uint8 blocks, qtype)} of every decoder linear and the LM head of `model`,
    quantised from its float weights by gguf-py (`gguf.quants.quantize`, llama.cpp's rule)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[qtype.upper()]
    out = {}
    for name, mod in _linears(model).items():
        w = mod.weight.detach().float().cpu().numpy()
        out[name] = (torch.from_numpy(np.ascontiguousarray(quantize(w, kind))), qtype)
    return out


def _linears(model: nn.Module) -> Dict[str, nn.Linear]:
    """The model's decoder linears and LM head, by module name."""
    head = model.get_output_embeddings()
    return {name: mod for name, mod in model.named_modules()
            if type(mod) is nn.Linear and mod.in_features % 32 == 0
            and (".layers." in f".{name}" or mod is head)}


# Beside the converted checkpoint, in a subfolder: tools that load every top-level
# *.safetensors of a checkpoint folder as weight shards (vLLM does) must not see it.
BLOCKS_FILE = "sharpdraft_quant/{}.safetensors"


def cached_blocks(folder: Path, mode: str, build) -> Dict[str, Tuple[torch.Tensor, str]]:
    """The blocks of `mode` ("gguf" or a qtype) stored in the converted target folder, built by
    `build()` and saved there the first time (written to a temporary file, then renamed: a
    killed save leaves nothing a later load reads)."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / BLOCKS_FILE.format(mode)
    if path.exists():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            qtypes = json.loads(f.metadata()["qtypes"])
        tensors = load_file(str(path))
        return {name: (tensors[name], qtypes[name]) for name in tensors}
    blocks = build()
    path.parent.mkdir(exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        save_file({name: b for name, (b, _) in blocks.items()}, tmp,
                  metadata={"qtypes": json.dumps({name: q for name, (_, q) in blocks.items()})})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return blocks


def quantise_linears(model: nn.Module, blocks: Dict[str, Tuple[torch.Tensor, str]]) -> dict:
    """Replace each `nn.Linear` of `model` named in `blocks` by a `QuantLinear` over its blocks.

    Returns:
        {"quantised": count by qtype, "dense": names of decoder linears left dense}.

    Raises:
        ValueError naming the module: blocks whose shape does not fit its layer.
    """
    counts: Dict[str, int] = {}
    linears = _linears(model)
    for name, (b, qtype) in blocks.items():
        mod = linears.get(name)
        if mod is None:
            continue
        try:
            new = QuantLinear(mod, b, qtype)
        except ValueError as err:
            raise ValueError(f"quantised weights of {name}: {err}") from err
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        counts[qtype] = counts.get(qtype, 0) + 1
    return {"quantised": counts, "dense": sorted(set(linears) - set(blocks))}


def choose_weights(model: nn.Module, blocks: Dict[str, Tuple[torch.Tensor, str]],
                   rows=(1, 8), repeats: int = 9) -> tuple:
    """The measured rule behind `--weights auto`: the quantised blocks where this CPU runs the
    model's largest decoder linear faster from them (`quant_linear`) than from its float32
    weight by the fastest dense path (`LINEAR_PATHS`), at one row (decode) and at rows[1]
    rows (verification); each call with the weights evicted from the caches, as in a forward.

    Returns:
        ("gguf" or "dense", {"quantised": [ms per row count], "float32": [...]}).
    """
    linears = _linears(model)
    named = [(n, m) for n, m in linears.items() if n in blocks and m is not
             model.get_output_embeddings()]
    if not named:
        return "dense", {}
    name, mod = max(named, key=lambda nm: nm[1].weight.numel())
    b, qtype = blocks[name]
    quant = QuantLinear(mod, b, qtype)
    w = mod.weight.detach().float()
    able = [p for p in paths_for(w) if p in linear_paths()] or ["dense"]
    dense = {p: pack_weight(w, p) for p in able}
    flush = torch.ones((64 << 20) // 4)
    ms = {"quantised": [], "float32": []}
    for m in rows:
        x = torch.randn(m, w.shape[1])
        fns = {("float32", p): (lambda p=p: run_path(p, x, w, dense[p], None)) for p in able}
        fns[("quantised", qtype)] = lambda: quant(x)
        t = interleaved_medians(fns, repeats, flush)
        for kind in ms:
            ms[kind].append(round(1e3 * min(v for (k, _), v in t.items() if k == kind), 4))
    faster = all(q < f for q, f in zip(ms["quantised"], ms["float32"]))
    return ("gguf" if faster else "dense"), ms


__all__ = ["BLOCKS_FILE", "QTYPES", "QUANT_MAX_ROWS", "QuantLinear", "WEIGHTS", "cached_blocks",
           "check_gguf", "choose_weights", "gguf_blocks", "quantise_linears",
           "requantised_blocks"]

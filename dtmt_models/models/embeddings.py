"""Token embeddings with optional scaled sinusoidal positional encoding (DTMT: x + PE / sqrt(d))."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import dtmt_kernels as dk


def _wavelengths(dim: int) -> list:
    """10000^(2i/dim) for each sin/cos pair i of the PE (Python floats: the C library's pow)."""
    return [10000.0 ** (i / dim) for i in range(0, dim, 2)]


def sinusoidal_positions(length: int, dim: int, device=None, dtype=torch.float32) -> Tensor:
    """The Transformer's PE table [length, dim]: sin(pos / 10000^(2i/dim)) on even, cos on odd features. Computed
    in float64 by Python's math (the C library's sin and cos, one value at a time) and rounded once to `dtype`, so
    the table is the same on every device and in every process, and exact to the model's precision. (torch's own
    float64 sin on the CPU is MKL's on two threads, and its first call in a process has come out an ulp apart in
    some processes: translations then differed from run to run; docs/design/decoding.md, "The first call of MKL's
    vector math".) On the meta device (a model built to read its shapes) nothing is computed."""
    if torch.device(device if device is not None else torch.get_default_device()).type == "meta":
        return torch.empty(length, dim, device="meta", dtype=dtype)
    columns = []
    for j, w in enumerate(_wavelengths(dim)):
        columns.append([math.sin(p / w) for p in range(length)])
        if 2 * j + 1 < dim:
            columns.append([math.cos(p / w) for p in range(length)])
    table = torch.tensor(columns, dtype=torch.float64).reshape(dim, length).t()
    return table.to(device=device, dtype=dtype)


def sinusoidal_at(positions: Tensor, dim: int) -> Tensor:
    """The PE rows of `positions` [...] -> [..., dim], in float64 on the positions' device, with torch's sin, cos
    and pow (the table's formula, where no table may be sized by the data: under torch.compile, in a CUDA graph, in a
    decoder step on a GPU). Nothing comes from the host: the wavelengths too are made on the device."""
    pos = positions.to(torch.float64).unsqueeze(-1)
    pairs = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
    angle = pos / torch.pow(10000.0, pairs / dim)
    pe = torch.zeros(*positions.shape, dim, dtype=torch.float64, device=positions.device)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle[..., : dim // 2])
    return pe


class TokenEmbedding(nn.Module):
    """Embedding lookup (padding row kept at zero), plus PE / sqrt(dim) when `positional` (paper 000 scales
    the encoding down so it does not swamp the word embedding of a recurrent model)."""

    def __init__(self, vocab_size: int, dim: int, pad_id: int = 0, positional: bool = False, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        self.dim, self.positional = dim, positional
        self.dropout = nn.Dropout(dropout)
        self._table = torch.empty(0, dim)   # PE / sqrt(dim), grown on demand (not a parameter, not saved)

    def scaled_positions(self, length: int, like: Tensor) -> Tensor:
        """[length, dim] rows of PE / sqrt(dim), cached on the module (not while torch.compile or torch.export
        traces: a table of fake tensors kept after an export broke every later call)."""
        t = self._table
        if t.shape[0] < length or t.device != like.device or t.dtype != like.dtype:
            n = max(length, 2 * t.shape[0], 64)
            t = sinusoidal_positions(n, self.dim, like.device, like.dtype) / math.sqrt(self.dim)
            if not torch.compiler.is_compiling():
                self._table = t
        return t[:length]

    @property
    def weight(self) -> Tensor:
        return self.embed.weight

    def forward(self, tokens: Tensor, positions: Tensor = None) -> Tensor:
        """tokens [B, T] (positions 0..T-1) or [B] with `positions` [B] (one decoder step)."""
        # F.embedding and index_select rather than the submodule and [positions], and no dropout call in eval
        # mode: the decoder step's path, kept free of module-call overhead (why: docs/design/decoding.md, "The
        # decoder step as one call")
        x = F.embedding(tokens, self.embed.weight, self.embed.padding_idx)
        if self.positional:
            if positions is None:
                x = x + self.scaled_positions(tokens.shape[-1], x)
            elif positions.device.type != "cpu" or not dk.functional.host_reads_allowed():
                # no table sized by the data (its size would be a read of the positions: on a GPU a synchronisation
                # every decoder step): these positions' rows
                # rounded to the model's dtype, then scaled, as the table is: the same rows as the CPU's table but
                # where torch's sin and cos round a float64 ulp the other way than the C library's
                x = x + sinusoidal_at(positions, self.dim).to(x.dtype) / math.sqrt(self.dim)
            else:
                table = self.scaled_positions(int(positions.max()) + 1, x)
                x = x + (table.index_select(0, positions) if positions.dim() == 1 else table[positions])
        return self.dropout(x) if self.training else x

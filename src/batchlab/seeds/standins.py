"""Dropout that takes its masks as inputs, for the seeds' forward under vmap (functional.py).

Under `torch.func.vmap` a random op draws one tensor for all the seeds from the global RNG
(`randomness="different"`) or the same one for each (`"same"`): neither is the mask a seed's
separate run draws. So the stacked forward runs a copy of the model (`stand_in`) whose nn.Dropout
and nn.MultiheadAttention layers take their masks from a `Masks` queue, and the masks are drawn
outside vmap, per seed from its own generator, in the order and shape its separate run draws
them, and handed in as vmapped inputs. On the CPU a training-mode dropout draws `bernoulli_(1 - p)`
into a tensor shaped like its input, divides it by 1 - p and multiplies (F.dropout; the attention
dropout of scaled_dot_product_attention's math kernel, which the CPU takes when dropout_p > 0,
does the same to the attention weights): a generator in the same state gives the same mask.

A recording pass (`Masks.record`) runs the stand-in once on an input shape and notes each draw
(shape, strides, p) in order; the layers draw nothing then, so a forward that still moves the
global RNG draws somewhere these stand-ins do not reach (functional.why_apart refuses it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Mask = torch.Tensor | None


class Unsupported(RuntimeError):
    """A layer whose dropout the stand-ins cannot take as masks (the message says why)."""


@dataclass(frozen=True)
class Draw:
    """One dropout draw of a forward: the mask's shape and strides (those F.dropout's noise has), and p."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    p: float
    contiguous: bool


class Masks:
    """The masks of one forward, handed to the stand-in layers in the order they call for them."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []
        self.recording: list[Draw] | None = None

    @contextmanager
    def record(self) -> Iterator[list[Draw]]:
        """Note the draws of the forwards run inside; no dropout is applied meanwhile."""
        self.recording = []
        try:
            yield self.recording
        finally:
            self.recording = None

    @contextmanager
    def feeding(self, masks: list[torch.Tensor]) -> Iterator[None]:
        """Hand out `masks` (each already divided by 1 - p) to the forward run inside, all of them."""
        self.queue = list(masks)
        try:
            yield
        finally:
            left, self.queue = len(self.queue), []
        if left:
            raise RuntimeError(f"the stacked forward left {left} of its dropout masks unused")

    def drop(self, x: torch.Tensor, p: float) -> torch.Tensor:
        """What F.dropout(x, p, training=True) gives, with the next mask."""
        if p == 0 or x.numel() == 0:  # F.dropout draws nothing then
            return x
        if p == 1:
            return x * torch.zeros((), dtype=x.dtype, device=x.device)
        if self.recording is not None:
            noise = torch.empty_like(x)  # what F.dropout draws into: x's strides where x is dense, else contiguous
            self.recording.append(Draw(tuple(x.shape), tuple(noise.stride()), float(p), noise.is_contiguous()))
            return x
        if not self.queue:
            raise RuntimeError("the stacked forward asked for more dropout masks than its recording drew")
        return x * self.queue.pop(0)


class MaskedDropout(nn.Dropout):
    """nn.Dropout with its mask from `masks` (set by `stand_in`)."""

    masks: Masks

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.masks.drop(input, self.p) if self.training else input


class MaskedAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention whose attention dropout takes its mask from `masks`: in training, the
    computation of F.multi_head_attention_forward (and its scaled_dot_product_attention's math
    kernel) written out for a packed input projection without bias_k/bias_v, zero attention or
    masks; torch's own forward otherwise (in eval mode, or without dropout)."""

    masks: Masks

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
        attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        why = self._why_not(query, key_padding_mask, attn_mask, is_causal)
        if why is not None:
            if self.training and self.dropout > 0:
                raise Unsupported(f"an nn.MultiheadAttention with dropout and {why}")
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        if self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        tgt_len, bsz, embed = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        assert self.in_proj_weight is not None  # _why_not: a packed projection
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(query, w_q, b_q).reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = F.linear(key, w_k, b_k).reshape(key.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = F.linear(value, w_v, b_v).reshape(value.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if need_weights:  # F.multi_head_attention_forward's own softmax path
            scores = torch.bmm(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
        else:  # scaled_dot_product_attention's math kernel: each side scaled by the root of the scale
            root = math.sqrt(1.0 / math.sqrt(head_dim))
            scores = torch.matmul(q * root, (k * root).transpose(-2, -1))
        weights = torch.softmax(scores, dim=-1)
        if self.training:
            weights = self.masks.drop(weights, self.dropout)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias).view(tgt_len, bsz, embed)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        per_head = weights.view(bsz, heads, tgt_len, -1)
        return out, per_head.mean(dim=1) if average_attn_weights else per_head

    def _why_not(self, query: torch.Tensor, padding: Mask, mask: Mask, causal: bool) -> str | None:
        """What of this call the written-out forward does not cover, or None."""
        checks = {
            "a 2-d (unbatched) input": query.dim() != 3,
            "separate q/k/v projections": not self._qkv_same_embed_dim,
            "bias_k/bias_v": self.bias_k is not None or self.bias_v is not None,
            "add_zero_attn": self.add_zero_attn,
            "an attention or key padding mask": padding is not None or mask is not None or causal,
        }
        found = [what for what, hit in checks.items() if hit]
        return found[0] if found else None


def stand_in(model: nn.Module, masks: Masks) -> nn.Module:
    """A copy of `model` whose nn.Dropout and nn.MultiheadAttention layers (those exact classes: a
    subclass may draw otherwise) take their masks from `masks`; the model itself is left as it is."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if type(module) is nn.Dropout:
            module.__class__ = MaskedDropout
        elif type(module) is nn.MultiheadAttention:
            module.__class__ = MaskedAttention
        else:
            continue
        setattr(module, "masks", masks)  # noqa: B010 (a plain attribute, not a submodule)
    return copied


def draw_masks(draws: list[Draw], generators: list[torch.Generator], device: torch.device) -> list[torch.Tensor]:
    """Each draw's masks [S, ...] (divided by 1 - p), seed i's from generators[i], drawn in the
    order of `draws` as F.dropout draws them: bernoulli_(1 - p) into a tensor of the input's layout."""
    out: list[torch.Tensor] = []
    for draw in draws:
        if draw.contiguous:
            masks = torch.empty((len(generators), *draw.shape), device=device)  # the seeds' parts of one buffer
            for part, generator in zip(masks.unbind(), generators, strict=True):
                part.bernoulli_(1 - draw.p, generator=generator)
        else:  # the strides of a separate run's empty_like(input): bernoulli_ fills in their order
            parts = [torch.empty_strided(draw.shape, draw.stride, device=device) for _ in generators]
            for part, generator in zip(parts, generators, strict=True):
                part.bernoulli_(1 - draw.p, generator=generator)
            masks = torch.stack(parts)
        out.append(masks.div_(1 - draw.p))
    return out

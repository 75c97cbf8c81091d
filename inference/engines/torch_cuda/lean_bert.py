"""The e5 (BERT) encoder forward written for few GPU kernels, for the ``torch_cuda`` engine.

Why: replayed as a CUDA graph, a small-batch e5-small forward on an H200 costs
what its kernels' launch latencies add up to, not what they compute (a graph of
20 x 27 tokens took 0.93 ms, about 4 us per kernel of transformers'
``BertModel`` with FP32 LayerNorms; docs/benchmarks.md, fourth session). This
forward computes the same function with about 40 % fewer kernels (by our count of
launched operations, ~12 per layer instead of ~20; measured: 24 % less time per batch):

- one GEMM for Q, K and V (the three weight matrices stacked once at load),
- activations kept 2-D ``[B*T, D]`` so every linear layer is one cuBLASLt GEMM
  with its bias fused, and ``scaled_dot_product_attention`` reads Q/K/V as
  strided views of that GEMM's output,
- LayerNorm on the FP16 activations with PyTorch's own kernel, which computes
  the mean and variance in FP32 (``acc_type``) and so avoids the FP16 variance
  overflow without casting the activations to FP32 and back around every
  LayerNorm (two kernels each, 50 per forward),
- the token-type-0 embedding row folded into the position table at load.

Math is BERT's (Devlin et al. 2019; transformers ``BertModel``, absolute
positions, exact erf GELU, post-LayerNorm), followed by mean pooling over the
unmasked tokens in FP32. The CPU FP32 result equals ``BertModel``'s to float
rounding (``tests/test_torch_cuda.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class _Layer:
    qkv_w: Any  # [3D, D]
    qkv_b: Any  # [3D]
    out_w: Any  # [D, D]
    out_b: Any
    ln1_w: Any
    ln1_b: Any
    ffn_in_w: Any  # [F, D]
    ffn_in_b: Any
    ffn_out_w: Any  # [D, F]
    ffn_out_b: Any
    ln2_w: Any
    ln2_b: Any


class LeanBert:
    """BERT weights on one device in ``dtype``, and a forward of few kernels.

    Args:
        bert: a transformers ``BertModel`` (any device/dtype; only read).
        device: the torch device to hold the weights.
        dtype: the compute dtype (``torch.float16`` on CUDA, ``torch.float32`` on CPU).

    Attributes:
        dim: hidden size D (384 for e5-small). heads: attention heads (12).
        max_positions: position table rows (512; positions are 0..T-1, as in
            ``BertModel``). eps: LayerNorm epsilon.
    """

    def __init__(self, bert: Any, device: Any, dtype: Any) -> None:
        import torch

        cfg = bert.config
        self.dim = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.max_positions = int(cfg.max_position_embeddings)
        self.eps = float(cfg.layer_norm_eps)
        self.dtype = dtype

        def t(x):
            return x.detach().to(device=device, dtype=dtype).contiguous()

        emb = bert.embeddings
        self.word = t(emb.word_embeddings.weight)
        # token_type_ids are always 0 for e5: fold that row into the position table.
        self.pos_type = t(emb.position_embeddings.weight + emb.token_type_embeddings.weight[0])
        self.emb_ln_w, self.emb_ln_b = t(emb.LayerNorm.weight), t(emb.LayerNorm.bias)
        self.layers: list[_Layer] = []
        for layer in bert.encoder.layer:
            att = layer.attention
            self.layers.append(_Layer(
                qkv_w=t(torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight])),
                qkv_b=t(torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias])),
                out_w=t(att.output.dense.weight), out_b=t(att.output.dense.bias),
                ln1_w=t(att.output.LayerNorm.weight), ln1_b=t(att.output.LayerNorm.bias),
                ffn_in_w=t(layer.intermediate.dense.weight), ffn_in_b=t(layer.intermediate.dense.bias),
                ffn_out_w=t(layer.output.dense.weight), ffn_out_b=t(layer.output.dense.bias),
                ln2_w=t(layer.output.LayerNorm.weight), ln2_b=t(layer.output.LayerNorm.bias)))

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take on the device (224 MiB for e5-small in FP16, most of
        it the word embeddings)."""
        tensors = [self.word, self.pos_type, self.emb_ln_w, self.emb_ln_b]
        tensors += [getattr(layer, f.name) for layer in self.layers for f in fields(layer)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, ids: Any, mask: Any) -> Any:
        """Mean-pooled sentence embeddings.

        Args:
            ids: int64[B, T] token ids on this model's device, T <= ``max_positions``.
            mask: int64[B, T], 1 for real tokens, 0 for padding; a row of all
                zeros (a padded batch row) gives finite garbage, never NaN
                (position 0 is always attended).

        Returns:
            float32[B, D], mean over the unmasked tokens (not normalized).
        """
        import torch
        import torch.nn.functional as F

        b, t = ids.shape
        d, h = self.dim, self.heads
        keep = mask.bool()
        keep[:, 0] = True  # never a fully masked softmax row
        # Additive mask built once (a boolean one is converted again in every layer).
        attn_mask = torch.zeros((b, t), dtype=self.dtype, device=ids.device).masked_fill_(
            ~keep, float("-inf"))[:, None, None, :]
        x = F.layer_norm(F.embedding(ids, self.word) + self.pos_type[:t], (d,), self.emb_ln_w, self.emb_ln_b,
                         self.eps).view(b * t, d)
        for L in self.layers:
            qkv = F.linear(x, L.qkv_w, L.qkv_b).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=attn_mask)
            a = a.transpose(1, 2).reshape(b * t, d)
            x = F.layer_norm(F.linear(a, L.out_w, L.out_b) + x, (d,), L.ln1_w, L.ln1_b, self.eps)
            f = F.gelu(F.linear(x, L.ffn_in_w, L.ffn_in_b))
            x = F.layer_norm(F.linear(f, L.ffn_out_w, L.ffn_out_b) + x, (d,), L.ln2_w, L.ln2_b, self.eps)
        m = mask.to(torch.float32)
        summed = torch.bmm(m[:, None, :], x.view(b, t, d).float())[:, 0]
        return summed / m.sum(dim=1, keepdim=True).clamp(min=1.0)

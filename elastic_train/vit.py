"""The built-in ``--model vit``: torchvision's ``VisionTransformer`` architecture, without torchvision.

Why not import it: ``import torchvision`` loads ``torch._dynamo`` (through ``torchvision.ops``),
~2.4 s of CPU on a 2-core machine, about as much as ``import torch`` itself. DDP's constructor
and FSDP2's hooks load ``torch._dynamo`` anyway, but a worker that trains the bare module (a
quorum replica of one process) does not need it, and pays it at every start: a replica that
rejoins after a failure is that much later. This module builds the same network from
``torch.nn`` alone.

"The same" is exact, and tested against torchvision (tests/unit/test_vit.py):

* the same module tree, parameter names and registration order, so state dicts, checkpoints,
  optimizer state and FSDP's per-block units are interchangeable with torchvision's;
* the same random draws in the same order at construction, so a seed gives bitwise the same
  initial weights (the seed path's pinned results depend on it);
* the same operations in the same order in the forward pass, so outputs and gradients are
  bitwise equal.

Only the configuration the trainer uses is built: a patchify convolution stem, a class token,
no representation layer, LayerNorm with eps 1e-6.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

_LN_EPS = 1e-6


def _layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=_LN_EPS)


class FeedForward(nn.Sequential):
    """Linear -> GELU -> Dropout -> Linear -> Dropout, keys ``0`` and ``3`` (torchvision's MLPBlock).

    The Linear layers are built (drawing PyTorch's default init) before the block's own init
    draws, exactly as torchvision orders them.
    """

    _version = 2  # torchvision's MLPBlock: the version its state dicts record for these keys

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
            nn.Dropout(dropout),
        )
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.normal_(layer.bias, std=1e-6)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(ln_1(x)), then + feed_forward(ln_2(.))."""

    def __init__(self, heads: int, dim: int, hidden: int, dropout: float, attention_dropout: float) -> None:
        super().__init__()
        self.num_heads = heads
        self.ln_1 = _layer_norm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = _layer_norm(dim)
        self.mlp = FeedForward(dim, hidden, dropout)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        normed = self.ln_1(inputs)
        attended, _ = self.self_attention(normed, normed, normed, need_weights=False)
        x = self.dropout(attended) + inputs
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class Encoder(nn.Module):
    """Learned position embedding, dropout, the blocks, a final LayerNorm."""

    def __init__(
        self, tokens: int, layers: int, heads: int, dim: int, hidden: int, dropout: float, attention_dropout: float
    ) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            OrderedDict(
                (f"encoder_layer_{i}", Block(heads, dim, hidden, dropout, attention_dropout)) for i in range(layers)
            )
        )
        self.ln = _layer_norm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ln(self.layers(self.dropout(tokens + self.pos_embedding)))
        return out


class VisionTransformer(nn.Module):
    """ViT (Dosovitskiy et al., 2020) for ``image_size`` square RGB images cut into
    ``patch_size`` patches; classifies from the class token."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        *,  # keyword-only from here: torchvision's positional order differs (dropout first)
        num_classes: int,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch_size}")
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, hidden_dim
        # Registration order (stem, class token, encoder, heads) is the parameter order.
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        tokens = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(tokens, num_layers, num_heads, hidden_dim, mlp_dim, dropout, attention_dropout)
        self.seq_length = tokens
        head = nn.Linear(hidden_dim, num_classes)
        self.heads = nn.Sequential(OrderedDict(head=head))
        # The stem: truncated normal scaled by its fan-in; the head starts at zero.
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        assert self.conv_proj.bias is not None  # Conv2d's default bias=True
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n, _c, h, w = images.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"expected {self.image_size}x{self.image_size} images, got {h}x{w}")
        grid = (h // self.patch_size) * (w // self.patch_size)
        # (n, c, h, w) -> (n, dim, grid) -> (n, grid, dim): a token per patch.
        patches = self.conv_proj(images).reshape(n, self.hidden_dim, grid).permute(0, 2, 1)
        tokens = torch.cat([self.class_token.expand(n, -1, -1), patches], dim=1)
        logits: torch.Tensor = self.heads(self.encoder(tokens)[:, 0])
        return logits

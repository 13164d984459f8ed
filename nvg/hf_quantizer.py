"""nvg's BLR weights inside transformers: `import nvg.hf_quantizer`, then
`AutoModelForCausalLM.from_pretrained(folder)` on a folder written by `nvg export-hf --packed`.

The folder's config.json carries `quantization_config: {"quant_method": "nvg", "format": "blr", ...}`
and lists every BLR linear with its paths and rank. Importing this module registers that config and
its quantizer with transformers; before the weights load, the quantizer swaps each listed `nn.Linear`
for a `BlrLinear` whose tensors are exactly the CMF payload's: h, ℓ, g (f16) and the sign bits
(uint8, LSB-first, 1 → +1), so the folder holds the student at its own size and nothing is re-quantised.

It is a module of its own, not part of `import nvg`, because transformers' quantizer registry takes
seconds to import and every pipeline stage imports nvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

QUANT_METHOD = "nvg"
FORMAT = "blr"
FORMAT_VERSION = 1
_BIT = torch.arange(8, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., n/8] (LSB-first, 1 → +1) → ±1 [..., n] in `dtype`, on the bits' device."""
    on = (bits.unsqueeze(-1) >> _BIT.to(bits.device)) & 1
    return on.reshape(*bits.shape[:-1], bits.shape[-1] * 8).to(dtype) * 2 - 1


class BlrLinear(nn.Module):
    """y = x · Wᵀ with W = Σ_p diag(h_p) · S_U,p · diag(ℓ_p) · S_V,p · diag(g_p), as nvg's own
    `nvg.model.BlrLinear` computes it: the scales are folded into the unpacked signs once per device
    and dtype (A = [diag(ℓ_p) S_V,p diag(g_p)]_p, B = [diag(h_p) S_U,p]_p, together P·r·(d_in + d_out)
    values, an eighth of the dense weight at 1 bpw), and the tokens see two GEMMs, y = (x Aᵀ) Bᵀ."""

    def __init__(self, in_features: int, out_features: int, paths: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("h", torch.zeros(paths, out_features, dtype=torch.float16))
        self.register_buffer("ell", torch.zeros(paths, rank, dtype=torch.float16))
        self.register_buffer("g", torch.zeros(paths, in_features, dtype=torch.float16))
        self.register_buffer("u_bits", torch.zeros(paths, out_features, rank // 8, dtype=torch.uint8))
        self.register_buffer("v_bits", torch.zeros(paths, rank, in_features // 8, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._folded: tuple | None = None  # (device, dtype, A, B): rebuilt when either changes

    def folded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.h.device, dtype)
        if self._folded is None or self._folded[:2] != key:
            paths, rank = self.ell.shape
            h, ell, g = (t.float() for t in (self.h, self.ell, self.g))
            a = unpack_signs(self.v_bits, torch.float32) * (ell[:, :, None] * g[:, None, :])
            b = unpack_signs(self.u_bits, torch.float32) * h[:, :, None]
            self._folded = (*key, a.reshape(paths * rank, self.in_features).to(dtype),
                            b.permute(1, 0, 2).reshape(self.out_features, paths * rank).to(dtype))
        return self._folded[2], self._folded[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.folded(x.dtype)
        y = F.linear(F.linear(x, a), b)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        paths, rank = self.ell.shape
        return f"in_features={self.in_features}, out_features={self.out_features}, paths={paths}, rank={rank}"


@register_quantization_config(QUANT_METHOD)
class NvgConfig(QuantizationConfigMixin):
    """`quantization_config` of an nvg export: `linears` maps each BLR module's name to its
    {"paths": P, "rank": r}; every other module is an ordinary transformers one."""

    def __init__(self, linears: dict | None = None, format: str = FORMAT, version: int = FORMAT_VERSION, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format, self.version, self.linears = format, version, dict(linears or {})
        if format != FORMAT or version != FORMAT_VERSION:
            raise ValueError(f"quantization_config: nvg format {format!r} version {version} is not {FORMAT!r} {FORMAT_VERSION}")
        for name, shape in self.linears.items():
            if not (isinstance(shape, dict) and shape.get("paths") in (1, 2) and isinstance(shape.get("rank"), int)
                    and shape["rank"] > 0 and shape["rank"] % 8 == 0):
                raise ValueError(f"quantization_config.linears[{name!r}]: {shape!r} is not {{paths: 1|2, rank: a positive multiple of 8}}")


@register_quantizer(QUANT_METHOD)
class NvgHfQuantizer(HfQuantizer):
    """Loads an nvg export as it was written (pre-quantised only: nvg's encoder needs the teacher's
    Grams, so there is no on-the-fly quantisation from a dense checkpoint)."""

    requires_calibration = True
    quantization_config: NvgConfig

    def _process_model_before_weight_loading(self, model, **kwargs):
        for name, shape in self.quantization_config.linears.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
            if not isinstance(old, nn.Linear):
                raise ValueError(f"quantization_config.linears: {name} is a {type(old).__name__}, not a Linear")
            setattr(parent, child, BlrLinear(old.in_features, old.out_features, shape["paths"], shape["rank"], old.bias is not None))

    def is_serializable(self, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

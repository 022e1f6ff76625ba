"""The packed INT4 weight format shared by calibration, the Triton kernel and the reference.

Layout (for a linear layer with weight W of shape [N, K], y = x @ W.T):

    qweight : uint8 [N, ceil(K / 2)]   two 4-bit codes per byte, packed along K:
                                        byte j of row n holds k = 2j in the low nibble and
                                        k = 2j + 1 in the high nibble (0 pads an odd K).
    scales  : float [G, N]              G = ceil(K / group_size); [G, N] so that one
                                        contiguous load serves a whole group of a tile.
    zeros   : float [G, N] or None      integer-valued zero-points in [0, 15] (asymmetric);
                                        None means symmetric, zero-point fixed at 8.

    dequant(W)[n, k] = (q[n, k] - z[k // g, n]) * s[k // g, n]

`group_size` is a power of two >= 32 (32, 64, 128, ...) or equal to K (one scale per output
channel). When K is not a multiple of `group_size`, the last group is partial: it covers the
remaining K - (G - 1) * g columns. This is the defined, tested behaviour (not an error).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Int4Weight", "pack_int4", "unpack_int4", "SYMMETRIC_ZERO"]

SYMMETRIC_ZERO = 8
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack integer codes [N, K] in [0, 15] into uint8 [N, ceil(K/2)] along K."""
    if q.dim() != 2:
        raise ValueError(f"pack_int4 expects [N, K] codes, got shape {tuple(q.shape)}")
    if q.is_floating_point():
        raise ValueError(f"pack_int4 expects integer codes, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"INT4 codes must lie in [0, 15], got range [{int(q.min())}, {int(q.max())}]")
    n, k = q.shape
    q = q.to(torch.uint8)
    if k % 2:
        q = torch.cat([q, torch.zeros(n, 1, dtype=torch.uint8, device=q.device)], dim=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [N, ceil(K/2)] -> uint8 codes [N, K]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 expects uint8 [N, ceil(K/2)], got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] != (k + 1) // 2:
        raise ValueError(f"packed width {packed.shape[1]} does not match K={k} (expected {(k + 1) // 2})")
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return out[:, :k].contiguous()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _valid_group(group_size: int, k: int) -> bool:
    return group_size == k or (group_size >= 32 and group_size & (group_size - 1) == 0)


@dataclass
class Int4Weight:
    """Packed INT4 weights of one linear layer; see the module docstring for the layout."""

    qweight: torch.Tensor  # uint8 [N, ceil(K/2)]
    scales: torch.Tensor  # float [G, N]
    zeros: torch.Tensor | None  # float [G, N] or None (symmetric)
    in_features: int  # K
    group_size: int  # g (== K for per-output-channel)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def n_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def validate(self) -> None:
        k, g = self.in_features, self.group_size
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"in_features must be a positive int, got {k!r}")
        if not _valid_group(g, k):
            raise ValueError(
                f"group_size {g} is not supported for K={k}: use a power of two >= 32 or K itself (per channel)"
            )
        if self.qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be uint8 (two INT4 codes per byte), got {self.qweight.dtype}")
        if self.qweight.dim() != 2 or self.qweight.shape[1] != (k + 1) // 2:
            raise ValueError(
                f"qweight must have shape [N, ceil(K/2)] = [N, {(k + 1) // 2}], got {tuple(self.qweight.shape)}"
            )
        if self.qweight.shape[1] > 1 and self.qweight.stride(1) != 1:
            # the kernels step through a row's bytes one at a time (rows may be strided: a slice of wider rows)
            raise ValueError(f"qweight's bytes must be contiguous along K (stride 1), got strides "
                             f"{self.qweight.stride()}")
        n = self.qweight.shape[0]
        if self.scales.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"scales must be fp16/bf16/fp32, got {self.scales.dtype}")
        if tuple(self.scales.shape) != (self.n_groups, n):
            raise ValueError(f"scales must have shape [G, N] = {(self.n_groups, n)}, got {tuple(self.scales.shape)}")
        # the kernels index group g, row n at g * N + n: any other layout would be read as the wrong values
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous [G, N] tensor, got strides {t.stride()} "
                                 f"(call .contiguous() first)")
        if self.zeros is not None:
            if self.zeros.dtype != self.scales.dtype or self.zeros.shape != self.scales.shape:
                raise ValueError(
                    f"zeros must match scales ({self.scales.dtype} {tuple(self.scales.shape)}), "
                    f"got {self.zeros.dtype} {tuple(self.zeros.shape)}"
                )
            # the kernels rely on it: the planes GEMM subtracts BIAS + z from 16-bit codes (BIAS 128 or 1024),
            # exact for these only
            # (a host read of device values: skipped while a CUDA graph is being captured, where it cannot run)
            z = self.zeros
            if z.device.type != "meta" and not _capturing() and not bool(
                    ((z == z.round()) & (z >= 0) & (z <= 15)).all()):
                raise ValueError("zeros must be integer-valued zero-points in [0, 15]")
        devices = {t.device for t in (self.qweight, self.scales, self.zeros) if t is not None}
        if len(devices) != 1:
            raise ValueError(f"qweight, scales and zeros must share one device, got {devices}")

    def codes(self) -> torch.Tensor:
        """Unpacked integer codes, uint8 [N, K]."""
        return unpack_int4(self.qweight, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float64, rows: slice = slice(None)) -> torch.Tensor:
        """Dequantized weights [N, K] in `dtype` (float64 by default: the ground truth); `rows` a contiguous slice
        of them ([rows, K]), so a large weight's float64 copy can be taken a piece at a time."""
        r0, r1, step = rows.indices(self.out_features)
        if step != 1:
            raise ValueError(f"Int4Weight.dequantize: rows must be a contiguous slice, got step {step}")
        q = unpack_int4(self.qweight[r0:r1], self.in_features).to(dtype)  # [R, K]
        col_group = torch.arange(self.in_features, device=q.device) // self.group_size  # [K]
        s = self.scales[:, r0:r1].to(dtype)[col_group].T  # [R, K]
        z = SYMMETRIC_ZERO if self.zeros is None else self.zeros[:, r0:r1].to(dtype)[col_group].T
        return (q - z) * s

    def nbytes(self) -> int:
        """Bytes this weight occupies in memory (what a GEMV must read)."""
        total = self.qweight.numel() + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            total += self.zeros.numel() * self.zeros.element_size()
        return total

    def to(self, device: torch.device | str) -> Int4Weight:
        return Int4Weight(
            self.qweight.to(device),
            self.scales.to(device),
            None if self.zeros is None else self.zeros.to(device),
            self.in_features,
            self.group_size,
        )

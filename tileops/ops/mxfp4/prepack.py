"""The prepacked MXFP4 weight: the OCP tensors re-laid, once at model load, in the order the
register-decoding kernel's threads consume them (`kernels.packed_program`).

The unit is an atom of 16 weight rows x 64 K columns, one warp's share of four 16-deep wgmma
k-steps with the weight as the register A operand. Lane l of the warp holds, per k-step s, the
eight elements of its A fragment: rows r = l // 4 and r + 8, columns c, c + 1, c + 8, c + 9
(c = 16 s + 2 (l % 4)). Those eight codes are one 32-bit word, so a lane's four k-steps are one
16-byte load and the 32 lanes read an atom's 512 bytes without a bank conflict:

  words  (N / 16, K / 64 * 128) int32: atom (R, a) at row R, columns 128 a ... 128 a + 127, lane l's
         word s at 4 l + s. Fragment element n of the word (pair p = n // 2: rows r, r + 8, r, r + 8
         for p = 0 ... 3; n % 2 the column's low bit) lies in half n % 2 of the word, its
         magnitude (the code's low three bits) at bit MAGNITUDE[p] of the half and its sign at
         bit SIGN[p]. A bf16 pair keeps its signs at bits 15 and 31 and its lowest exponent and
         top mantissa bits at 6..8 and 22..24: pair 2 is there already (one mask), pair 0 one
         shift away (sign nine bits above the magnitude), pairs 1 and 3 two shifts: 11 integer
         instructions for a word's eight values (`packed_kernels.RS_SOURCE`).
  scales (N / 16, K / 64 * 32) int16: bf16 bit patterns, atom (R, a) at 32 a + 4 (row % 8) + 2 b + h
         for row 16 R + 8 h + row % 8 and scale block b of the atom's two: a lane's four scales
         are one 8-byte load. A decoded pair read as bf16 is its values times 2^-126, so the
         scale 2^(e - 127) is stored times 2^126, as 2^(e - 1), for e <= 128; NaN (e = 255)
         as 0x7FC0; e = 129 ... 254, beyond bf16 once multiplied, as -2^(e - 127), the sign
         telling the kernel to multiply by -2^126 first (exact either way, rounded once).

The layout is the same for every tile size of the kernel; `LAYOUT` names it in records and errors.
`unpack` gives back the OCP tensors bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import ATOM_K, ATOM_ROWS, BLOCK
from .format import check_packed
from .packed_kernels import MAGNITUDE, SIGN

LAYOUT = "sm90-rs-atom16x64-v2"


@dataclass(frozen=True)
class PrepackedMxfp4:
    """An (N, K) MXFP4 weight in the kernel's order (module docstring); made by `prepack_mxfp4`."""

    words: torch.Tensor
    scales: torch.Tensor
    N: int
    K: int
    layout: str = LAYOUT

    @property
    def device(self) -> torch.device:
        return self.words.device

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The OCP tensors (w_fp4 (N, K/2), w_scale (N, K/32)), bit for bit those prepacked."""
        return unpack(self)


def _fragment_index(device: torch.device) -> tuple[torch.Tensor, ...]:
    """For (lane, word, fragment element n): the element's row and column within its atom, and
    the bits of the word where its magnitude and its sign lie."""
    lane = torch.arange(32, device=device).view(32, 1, 1)
    word = torch.arange(4, device=device).view(1, 4, 1)
    n = torch.arange(8, device=device).view(1, 1, 8)
    row = lane // 4 + 8 * ((n // 2) % 2)
    col = 16 * word + 8 * (n // 4) + 2 * (lane % 4) + n % 2
    half = 16 * (n % 2)
    magnitude = torch.tensor(MAGNITUDE, device=device)[n // 2] + half
    sign = torch.tensor(SIGN, device=device)[n // 2] + half
    return tuple(t.expand(32, 4, 8) for t in (row, col, magnitude, sign))


def _scale_index(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of an atom's 32 scale slots: its row within the atom and its scale block."""
    slot = torch.arange(32, device=device)
    row = slot // 4 + 8 * (slot % 2)
    return row, (slot // 2) % 2


def _check_shape(N: int, K: int) -> None:
    if N % ATOM_ROWS or K % ATOM_K:
        raise ValueError(f"prepack_mxfp4: an {N}x{K} weight does not tile into {ATOM_ROWS}x"
                         f"{ATOM_K} atoms (N a multiple of {ATOM_ROWS}, K of {ATOM_K}); call "
                         "mxfp4_gemm(a, w_fp4, w_scale) with the OCP tensors instead")


def prepack_mxfp4(w_fp4: torch.Tensor, w_scale: torch.Tensor) -> PrepackedMxfp4:
    """Re-lay an OCP MXFP4 weight (`quantize_mxfp4`'s tensors) for `mxfp4_gemm(a, packed)`.

    N must be a multiple of 16 and K of 64. Runs on the tensors' device, once per weight."""
    N, K = check_packed(w_fp4, w_scale, "prepack_mxfp4")
    _check_shape(N, K)
    dev = w_fp4.device
    fp4 = w_fp4.contiguous()
    codes = torch.stack((fp4 & 15, fp4 >> 4), dim=-1).view(N, K).to(torch.int64)
    atoms = codes.view(N // ATOM_ROWS, ATOM_ROWS, K // ATOM_K, ATOM_K)
    row, col, magnitude, sign = _fragment_index(dev)
    picked = atoms[:, row, :, col]  # (32, 4, 8, N/16, K/64): advanced indices go first
    placed = (((picked & 7) << magnitude.view(32, 4, 8, 1, 1))
              | ((picked >> 3) << sign.view(32, 4, 8, 1, 1)))
    words = placed.sum(dim=2, dtype=torch.int64)
    words = words.permute(2, 3, 0, 1).reshape(N // ATOM_ROWS, K // ATOM_K * 128)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    e = w_scale.contiguous().to(torch.int32)
    bf16 = torch.where(e <= 128, (e + 126) << 7,
                       torch.where(e == 255, 0x7FC0, 0x8000 | (e << 7)))
    blocks = bf16.view(N // ATOM_ROWS, ATOM_ROWS, K // ATOM_K, ATOM_K // BLOCK)
    srow, sblock = _scale_index(dev)
    scales = blocks[:, srow, :, sblock]  # (32, N/16, K/64)
    scales = scales.permute(1, 2, 0).reshape(N // ATOM_ROWS, K // ATOM_K * 32)
    scales = torch.where(scales >= 1 << 15, scales - (1 << 16), scales).to(torch.int16)
    return PrepackedMxfp4(words.contiguous(), scales.contiguous(), N, K)


def unpack(packed: PrepackedMxfp4) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `prepack_mxfp4`."""
    N, K, dev = packed.N, packed.K, packed.words.device
    words = packed.words.to(torch.int64) & 0xFFFFFFFF
    words = words.view(N // ATOM_ROWS, K // ATOM_K, 32, 4).permute(2, 3, 0, 1)  # (32,4,R,A)
    row, col, magnitude, sign = _fragment_index(dev)
    words = words.unsqueeze(2)  # (32, 4, 1, R, A)
    nibbles = (((words >> magnitude.view(32, 4, 8, 1, 1)) & 7)
               | (((words >> sign.view(32, 4, 8, 1, 1)) & 1) << 3))  # (32, 4, 8, R, A)
    atoms = torch.empty(N // ATOM_ROWS, ATOM_ROWS, K // ATOM_K, ATOM_K, dtype=torch.int64,
                        device=dev)
    atoms[:, row, :, col] = nibbles
    codes = atoms.view(N, K // 2, 2)
    w_fp4 = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)

    bits = packed.scales.to(torch.int32) & 0xFFFF
    bits = bits.view(N // ATOM_ROWS, K // ATOM_K, 32).permute(2, 0, 1)  # (32, R, A)
    srow, sblock = _scale_index(dev)
    blocks = torch.empty(N // ATOM_ROWS, ATOM_ROWS, K // ATOM_K, ATOM_K // BLOCK,
                         dtype=torch.int32, device=dev)
    blocks[:, srow, :, sblock] = bits
    e = torch.where(blocks == 0x7FC0, 255,
                    torch.where(blocks >= 0x8000, (blocks >> 7) & 0xFF, (blocks >> 7) - 126))
    return w_fp4, e.view(N, K // BLOCK).to(torch.uint8)

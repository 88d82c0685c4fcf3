"""A preallocated slot KV cache behind the model's ``kv_cache.attend`` hook.

Layout: one K and one V tensor of shape [layers, slots, n_kv_heads, max_len, head_dim] in the
model dtype, zero-initialised (masked positions are multiplied by 0 in attention, and 0 * NaN
would poison a row, so the memory must hold finite values). A sequence owns one slot; its token
at position t lives at [:, slot, :, t]. The engine keeps the live sequences in slots
0..n-1 (`move` compacts after sequences finish), so a decode step reads plain views
``K[layer, :n, :, :kv_len]`` and never gathers.

Two step kinds, set by the engine before each forward:

- prefill (`begin_prefill`): u distinct prompts, right-padded to T, each written to one or more
  slots (n samples of a prompt share one prefill); attention is causal within the prompt (a new
  slot has no earlier context, and padded queries are never read).
- decode (`begin_decode`): one new token per live slot 0..n-1 at its own position; attention
  over cached positions 0..pos of each row.

Nothing here reads the device from the host: step setup takes host lists (copied without a
stream sync, `to_device`) and the decode length from the engine, which knows it.

CUDA attention kernels (torch 2.11, H200, measured): the decode call (a boolean mask, and
``enable_gqa`` with fewer KV heads than query heads) is refused by flash attention (no masks)
and by the memory-efficient kernel (no grouped KV heads in 2.11); in bf16 it runs on cuDNN,
in fp32 on the math kernel. The prefill call (causal, no mask) runs on cuDNN's flash kernel
in bf16. Folding the query group into the query length (T = 1 in decode: q viewed as
[n, n_kv, group, hd], no ``enable_gqa``) ran 13% faster on cuDNN, equal within bf16 rounding;
not done, as it is not provably bit-identical on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def to_device(values: list[int] | list[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``. On CUDA the copy is queued on the current
    stream (the one the engine computes on) with ``non_blocking``, so torch does not
    synchronise the stream after it as it does after a blocking copy; CUDA stages a pageable
    source before the call returns (copies this small go into the command stream), so the
    host tensor need not outlive the call."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len
        self._mode: str | None = None
        self._dst: torch.Tensor | None = None  # prefill: slot of each written row
        self._src: torch.Tensor | None = None  # prefill: prompt row feeding it
        self._pos: torch.Tensor | None = None  # decode: position of the new token per slot
        self._mask: torch.Tensor | None = None
        self._kv_len = 0
        self._rows: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def fits(self, num_layers: int, slots: int, max_len: int, dtype: torch.dtype, device) -> bool:
        return (
            self.k.shape[0] == num_layers
            and self.slots >= slots
            and self.max_len >= max_len
            and self.k.dtype == dtype
            and self.k.device == torch.device(device)
        )

    # ------------------------------------------------------------------------- step setup

    def begin_prefill(self, dst_slots: list[int], src_rows: list[int]) -> None:
        """Next forward is a prefill of u prompts; prompt row src_rows[i] fills slot
        dst_slots[i] (several slots may take the same row)."""
        device = self.k.device
        self._mode = "prefill"
        self._dst = to_device(dst_slots, torch.long, device)
        self._src = to_device(src_rows, torch.long, device)

    def begin_decode(self, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward decodes one token for each of slots 0..n-1; positions: int64 [n] on
        the cache's device; kv_len: max(positions) + 1, from the host (reading it from the
        device would wait for every queued kernel)."""
        self._mode = "decode"
        self._pos = positions
        self._kv_len = int(kv_len)
        ar = torch.arange(self._kv_len, device=positions.device)
        self._mask = (ar[None, :] <= positions[:, None])[:, None, None, :]  # [n, 1, 1, kv_len]
        self._rows = torch.arange(positions.shape[0], device=positions.device)

    # ------------------------------------------------------------------------- the hook

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [B, H, T, hd], k/v [B, n_kv, T, hd] (post-RoPE) -> [B, H, T, hd]."""
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if self._mode == "prefill":
            t = k.shape[2]
            kc[self._dst, :, :t] = k[self._src]
            vc[self._dst, :, :t] = v[self._src]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self._mode == "decode":
            n = q.shape[0]
            kc[self._rows, :, self._pos] = k[:, :, 0]
            vc[self._rows, :, self._pos] = v[:, :, 0]
            return F.scaled_dot_product_attention(
                q,
                kc[:n, :, : self._kv_len],
                vc[:n, :, : self._kv_len],
                attn_mask=self._mask,
                enable_gqa=True,
            )
        raise RuntimeError("SlotKVCache.attend called outside begin_prefill/begin_decode")

    # ------------------------------------------------------------------------- slot moves

    def move(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Copy the first lengths[i] positions of slot src[i] into slot dst[i] (all layers)."""
        for s, d, n in zip(src, dst, lengths):
            self.k[:, d, :, :n] = self.k[:, s, :, :n]
            self.v[:, d, :, :n] = self.v[:, s, :, :n]

"""Python face of the ``offload._copier`` byte movers.

A *page* is the bytes of ONE block across all layers of a KV-cache group.
Buffers produced by :meth:`GroupPages.gather` are layer-major: for each layer,
for each requested block, that block's segments in order.  The C++ side trusts
the addresses it is given, so every bounds check against the KV tensors
happens here.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from offload import _copier

try:  # built by `make setup` (scripts/cuda_build.sh); absent in a build without nvcc
    from offload import _copier_cuda
except ImportError:
    _copier_cuda = None


def cuda_page_table(specs: list, device_index: int) -> tuple[object | None, str]:
    """``offload._copier_cuda.PageTable`` for ``device_index``, or None and why not.

    None when the extension is not built or cannot use the device (no GPU, no
    driver, a driver older than the extension's CUDA runtime): the caller then
    copies with torch on CUDA, and with the CPU copier (``offload._copier``) on
    CPU, which never needs this module.
    """
    if _copier_cuda is None:
        return None, "offload._copier_cuda is not built (make cuda-build)"
    try:
        return _copier_cuda.PageTable(specs, device_index), ""
    except _copier_cuda.NoCudaDevice as e:
        return None, str(e)


@dataclass(frozen=True)
class LayerPages:
    """Where block ``b``'s bytes live in one layer's KV tensor.

    The page part of block ``b`` is the concatenation, in order, of
    ``[base_ptr + b*block_stride + off, +seg_bytes)`` for ``off`` in
    ``seg_offsets``.  ``tensor`` (if set) keeps the memory alive while a
    PageTable holds its raw address, and enables the torch fallback on CUDA.
    """

    base_ptr: int
    block_stride: int
    seg_offsets: tuple[int, ...]
    seg_bytes: int
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, num_blocks: int) -> LayerPages:
        """Describe ``t`` whose FIRST dim of size ``num_blocks`` is the block dim.

        Dims before it (e.g. K/V) become separate segments; dims after it must
        be contiguous (size-1 dims ignored) so each segment is one memcpy.
        Padded per-block pages (vLLM's Mamba/GDN state) are fine: only the
        described bytes are moved, ``block_stride`` skips the padding.
        """
        shape, strides, es = tuple(t.shape), t.stride(), t.element_size()
        d = next((i for i, s in enumerate(shape) if s == num_blocks), None)
        if d is None:
            raise ValueError(f"no dim of size num_blocks={num_blocks} in shape {shape}")
        expected = 1
        for size, stride in reversed(list(zip(shape[d + 1:], strides[d + 1:]))):
            if size == 1:
                continue
            if stride != expected:
                raise ValueError(
                    f"dims after the block dim are not contiguous: shape {shape}, strides {strides}"
                )
            expected *= size
        seg_elems = 1
        for size in shape[d + 1:]:
            seg_elems *= size
        offsets = tuple(
            sum(i * s for i, s in zip(idx, strides[:d])) * es
            for idx in itertools.product(*(range(n) for n in shape[:d]))
        )
        return cls(t.data_ptr(), strides[d] * es, offsets, seg_elems * es, t)

    @property
    def page_bytes(self) -> int:
        return len(self.seg_offsets) * self.seg_bytes


class GroupPages:
    """Gathers/scatters whole pages of a group of layers sharing block ids.

    ``num_threads`` > 1 splits large CPU copies (>= 16 MiB) across threads.
    """

    def __init__(self, layers: Sequence[LayerPages], num_blocks: int, device: torch.device,
                 num_threads: int = 1):
        self.layers = tuple(layers)
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        specs = [(lp.base_ptr, lp.block_stride, list(lp.seg_offsets), lp.seg_bytes) for lp in self.layers]
        self._table = _copier.PageTable(specs, num_threads)
        self._cuda = self.device.type == "cuda"
        # Kernel path needs the extension and a usable device; otherwise torch ops on the tensors.
        self._cuda_table, why = (
            cuda_page_table(specs, self._device_index()) if self._cuda else (None, "")
        )
        if self._cuda and self._cuda_table is None and any(lp.tensor is None for lp in self.layers):
            raise ValueError(f"CUDA without the copy kernel ({why}) needs LayerPages.from_tensor")

    @property
    def backend(self) -> str:
        """Who moves the bytes: "cpu" (offload._copier), "cuda" (offload._copier_cuda) or "torch"."""
        return "cpu" if not self._cuda else "cuda" if self._cuda_table is not None else "torch"

    def _device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    @property
    def page_bytes(self) -> int:
        return self._table.page_bytes

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(b) for b in ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} out of range [0, {self.num_blocks})")
        return ids

    def _cuda_args(self) -> tuple[int, int]:
        idx = self._device_index()
        # Current stream: orders the copy after pending writes to the KV cache.
        return idx, torch.cuda.current_stream(idx).cuda_stream

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 CPU tensor with ``len(block_ids)`` pages, layer-major.

        A new tensor unless ``out`` (contiguous uint8 CPU, pinned on CUDA) is
        given: reusing buffers avoids page-faulting fresh memory, which costs
        more than the copy itself.
        """
        ids = self._check_ids(block_ids)
        n = len(ids) * self.page_bytes
        if out is None:
            # Pinned on CUDA: the kernel writes host memory directly via UVA.
            out = torch.empty(n, dtype=torch.uint8, pin_memory=self._cuda)
        else:
            _check_cpu_u8(out, "out")
            if out.numel() != n or (self._cuda and not out.is_pinned()):
                raise ValueError(f"out must hold exactly {n} bytes (pinned when on CUDA)")
        if not self._cuda:
            self._table.gather(ids, out.data_ptr(), n)
        elif self._cuda_table is not None:
            self._cuda_table.gather(ids, out.data_ptr(), n, *self._cuda_args())
        else:
            self._torch_gather(ids, out)
        return out

    def gather_crc(self, block_ids: Sequence[int], out: torch.Tensor, ghash: Ghash | None = None) -> int | None:
        """`gather` into ``out``, returning the CRC-32C of what it wrote (and hashing it into
        ``ghash``, a MAC's hash, where given), taken in the copy's own pass on CPU: each piece
        CRC'd and hashed from cache right after it is copied, so a writer frames the buffer
        without reading it back from memory. None on CUDA, where the device copies (and
        ``ghash`` is not fed): a writer computes it, off the forward path."""
        if self._cuda:
            self.gather(block_ids, out=out)
            return None
        ids = self._check_ids(block_ids)
        n = len(ids) * self.page_bytes
        _check_cpu_u8(out, "out")
        if out.numel() != n:
            raise ValueError(f"out must hold exactly {n} bytes")
        return self._table.gather_crc(ids, out.data_ptr(), n, 0, ghash)

    def scatter(self, buf: torch.Tensor, n_buf_blocks: int, pairs: Sequence[tuple[int, int]],
                crc: bool = False, ghash: Ghash | None = None) -> int | None:
        """Copy page ``src`` of ``buf`` (layer-major, ``n_buf_blocks`` pages) into block ``dst``.

        With ``crc``, also return the CRC-32C of the whole of ``buf`` (a CPU buffer); with
        ``ghash``, hash the whole of ``buf`` into it (a MAC's hash). On CPU both are taken in the
        copy's own pass over ``buf`` where the pairs read it front to back (every page once, in
        order); elsewhere before the copy.
        """
        pairs = [(int(s), int(d)) for s, d in pairs]
        self._check_ids([d for _, d in pairs])
        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise ValueError("buf must be a contiguous uint8 tensor")
        if not self._cuda:
            _check_cpu_u8(buf, "buf")
            if ghash is not None:
                value = crc32c(buf) if crc else None  # a MAC's check does not need the CRC: not fused
                self._table.scatter_ghash(buf.data_ptr(), buf.numel(), n_buf_blocks, pairs, ghash)
                return value
            if crc:
                return self._table.scatter_crc(buf.data_ptr(), buf.numel(), n_buf_blocks, pairs)
            self._table.scatter(buf.data_ptr(), buf.numel(), n_buf_blocks, pairs)
            return None
        # A host buffer: its CRC and hash on the CPU, before the copy.
        value = crc32c(buf) if crc else None
        if ghash is not None:
            _check_cpu_u8(buf, "buf")
            ghash.update(buf.data_ptr(), buf.numel())
        self._scatter_device(buf, n_buf_blocks, pairs)
        return value

    def _scatter_device(self, buf: torch.Tensor, n_buf_blocks: int, pairs: list[tuple[int, int]]) -> None:
        if self._cuda_table is not None:
            # The kernel can read pinned host or device memory, not pageable.
            if buf.device.type == "cpu" and not buf.is_pinned():
                buf = buf.to(self.device)
            self._cuda_table.scatter(buf.data_ptr(), buf.numel(), n_buf_blocks, pairs, *self._cuda_args())
        else:
            self._torch_scatter(buf, n_buf_blocks, pairs)

    # -- torch fallback (CUDA without the extension); also valid on CPU ------
    def _segment_views(self, layer: LayerPages) -> list[torch.Tensor]:
        """Byte views [num_blocks, seg_bytes] of each segment of ``layer``."""
        t = layer.tensor
        assert t is not None
        st = t.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        base = layer.base_ptr - st.data_ptr()
        return [
            raw.as_strided((self.num_blocks, layer.seg_bytes), (layer.block_stride, 1), base + off)
            for off in layer.seg_offsets
        ]

    def _torch_gather(self, ids: list[int], out: torch.Tensor) -> None:
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = 0
        for layer in self.layers:
            part = torch.cat([v.index_select(0, idx) for v in self._segment_views(layer)], dim=1)
            n = part.numel()
            out[pos:pos + n].copy_(part.reshape(-1), non_blocking=True)
            pos += n
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _torch_scatter(self, buf: torch.Tensor, n_buf: int, pairs: list[tuple[int, int]]) -> None:
        if buf.numel() != n_buf * self.page_bytes:
            raise ValueError(f"buf has {buf.numel()} bytes, expected {n_buf * self.page_bytes}")
        if any(not 0 <= s < n_buf for s, _ in pairs):
            raise ValueError(f"src index out of range [0, {n_buf})")
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        buf = buf.to(self.device, non_blocking=True)
        pos = 0
        for layer in self.layers:
            n = n_buf * layer.page_bytes
            part = buf[pos:pos + n].view(n_buf, len(layer.seg_offsets), layer.seg_bytes)
            for k, v in enumerate(self._segment_views(layer)):
                v.index_copy_(0, dst, part[:, k].index_select(0, src))
            pos += n
        if self._cuda:  # the caller may reuse ``buf`` as soon as we return
            torch.cuda.current_stream(self.device).synchronize()


def _check_cpu_u8(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous uint8 CPU tensor, got {t.dtype} on {t.device}")


def crc32c(buf: torch.Tensor | bytes | bytearray | memoryview, seed: int = 0) -> int:
    """CRC-32C (Castagnoli); ``seed`` chains: crc32c(b, crc32c(a)) == crc32c(a + b)."""
    if isinstance(buf, torch.Tensor):
        _check_cpu_u8(buf, "buf")
        return _copier.crc32c(buf.data_ptr(), buf.numel(), seed)
    return _copier.crc32c_buffer(buf, seed)


# GCM's GHASH for the chunk MAC (AES-256-GMAC), fed in the copier's own passes; see csrc/ghash.h.
Ghash = _copier.Ghash


def ghash_available() -> bool:
    """Whether the MAC's hash is the copier's on this CPU: where `Ghash` takes its AVX-512 path
    (x86-64 with VPCLMULQDQ), as fast as cryptography's GMAC or faster, and fed in the copier's
    own passes. Elsewhere the MAC is cryptography's GMAC in a pass of its own: the copier's
    128-bit path (`Ghash(wide=False)`, which tests hold to the same tags) is slower than it."""
    return bool(_copier.ghash_wide())


def crc32c_ghash(buf: torch.Tensor, ghash: Ghash, seed: int = 0) -> int:
    """CRC-32C of `buf`, hashing it into `ghash` in the same pass over the bytes."""
    _check_cpu_u8(buf, "buf")
    return _copier.crc32c_ghash(buf.data_ptr(), buf.numel(), ghash, seed)


def write_file(tmp_path: str | os.PathLike, final_path: str | os.PathLike, header: bytes,
               payload: torch.Tensor, fsync: bool, mode: int = 0o640) -> None:
    """Write header+payload to a fresh ``tmp_path`` (O_EXCL), then rename to ``final_path``.

    Readers never see a partial file; on error the tmp file is removed and
    OSError (with errno) is raised.
    """
    _check_cpu_u8(payload, "payload")
    _copier.write_file(os.fspath(tmp_path), os.fspath(final_path), bytes(header),
                       payload.data_ptr(), payload.numel(), bool(fsync), mode)


def read_file(path: str | os.PathLike, header_len: int, out: torch.Tensor,
              with_crc: bool = True) -> tuple[bytes, int]:
    """Read a file of exactly ``header_len + out.numel()`` bytes; returns (header, crc32c(payload)),
    the CRC computed piece by piece as the payload arrives (0 with ``with_crc=False``).

    A file of any other size raises ValueError before anything is read.
    """
    _check_cpu_u8(out, "out")
    return _copier.read_file(os.fspath(path), header_len, out.data_ptr(), out.numel(), with_crc)


def read_file_direct(path: str | os.PathLike, header_len: int, buf: torch.Tensor,
                     payload_len: int, with_crc: bool = True) -> tuple[bytes, int, bool]:
    """Read a whole file of exactly ``header_len + payload_len`` bytes into the
    front of ``buf``; returns (header, crc32c(payload), O_DIRECT used).

    With O_DIRECT when ``buf`` starts on a ``DIRECT_ALIGN`` boundary and holds
    the file's length rounded up to it (the tail past the file is scratch), and
    the filesystem accepts O_DIRECT; otherwise a buffered read of the same
    bytes. Sizes and errors as in :func:`read_file`.
    """
    _check_cpu_u8(buf, "buf")
    if header_len + payload_len > buf.numel():
        raise ValueError(f"buf has {buf.numel()} bytes, the file needs {header_len + payload_len}")
    return _copier.read_file_direct(os.fspath(path), header_len, buf.data_ptr(), buf.numel(), payload_len,
                                    with_crc)


def read_header(path: str | os.PathLike, header_len: int) -> bytes:
    """First ``header_len`` bytes of ``path`` (ValueError if shorter)."""
    return _copier.read_header(os.fspath(path), header_len)


DIRECT_ALIGN = 4096  # O_DIRECT buffer, length and offset alignment used by write_file_direct


def write_file_direct(tmp_path: str | os.PathLike, final_path: str | os.PathLike, buf: torch.Tensor,
                      file_len: int, fsync: bool, mode: int = 0o640, direct: bool = True) -> bool:
    """Write the first ``file_len`` bytes of ``buf`` (header and payload, already
    in place) to a fresh ``tmp_path``, then rename to ``final_path``.

    With O_DIRECT when ``buf`` starts on a ``DIRECT_ALIGN`` boundary, holds
    ``file_len`` rounded up to it, and the filesystem accepts O_DIRECT (a last
    partial block is written buffered). Otherwise a buffered write, same bytes.
    ``direct=False`` forces the buffered write (a filesystem probed to refuse
    O_DIRECT). Returns whether O_DIRECT was used. Errors as in :func:`write_file`.
    """
    _check_cpu_u8(buf, "buf")
    if not 0 <= file_len <= buf.numel():
        raise ValueError(f"file_len {file_len} outside the buffer's {buf.numel()} bytes")
    aligned_len = -(-file_len // DIRECT_ALIGN) * DIRECT_ALIGN
    buf_len = aligned_len if direct and aligned_len <= buf.numel() else file_len
    return _copier.write_file_direct(os.fspath(tmp_path), os.fspath(final_path), buf.data_ptr(),
                                     file_len, buf_len, bool(fsync), mode)


def copy_crc(dst: torch.Tensor, src: torch.Tensor, seed: int = 0, ghash: Ghash | None = None) -> int:
    """Copy ``src`` into ``dst`` (contiguous uint8 CPU tensors of one size) and return the
    CRC-32C of the bytes, taken piece by piece in the copy's own pass (one read of ``src``);
    with ``ghash``, the bytes are hashed into it in the same pass."""
    _check_cpu_u8(dst, "dst")
    _check_cpu_u8(src, "src")
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} bytes, src {src.numel()}")
    return _copier.copy_crc(dst.data_ptr(), src.data_ptr(), src.numel(), seed, ghash)


def memcpy(dst: torch.Tensor, src: torch.Tensor, num_threads: int = 1) -> None:
    """Contiguous copy of ``src`` into ``dst`` (host tensors, same byte count), split across
    threads as PageTable copies are. The tiers' host-to-host copy: torch's ``copy_`` of the same
    bytes costs twice the CPU and starts an OpenMP team on every I/O thread that calls it."""
    _check_cpu_u8(dst, "dst")
    _check_cpu_u8(src, "src")
    if dst.numel() != src.numel():
        raise ValueError(f"dst has {dst.numel()} bytes, src {src.numel()}")
    _copier.memcpy(dst.data_ptr(), src.data_ptr(), src.numel(), num_threads)

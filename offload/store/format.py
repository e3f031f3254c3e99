"""On-disk format of one (chunk, group) file. See docs/format.md.

A file is a fixed `HEADER_LEN`-byte little-endian header followed by the
payload: the group's pages for that chunk, layer-major (layer, then block,
then segment), exactly as `offload.copier.GroupPages.gather` lays them out. A
reader trusts nothing it has not verified: magic, version, every identity
field against what it asked for, the header's own CRC, the payload length and
the payload CRC, and, with a deployment key, the MAC (offload/store/auth.py).

`HEADER_LEN` is the only place the header's size lives; everything else
(buffers, tools, tests) derives from it, and a plan asks `file_bytes`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from offload.keys import FORMAT_VERSION, ChunkKey, Fingerprint
from offload.planner import GroupKind

MAGIC = b"KVOFFLD\x00"
HEADER_LEN = 192
# magic, version, header_len, group, kind, fingerprint, key, token_start,
# token_end, num_pages, page_bytes, payload_len, payload_crc, parent, key_id,
# reserved (zeros), mac, header_crc
_STRUCT = struct.Struct("<8sHHHH32s32sQQIIQI8s8s24s32sI")
assert _STRUCT.size == HEADER_LEN
KEY_ID_LEN = 8
MAC_LEN = 32
# The MAC covers the header bytes before it (every field but the MAC and the
# header CRC, which covers the MAC) and then the payload.
MAC_OFFSET = HEADER_LEN - 4 - MAC_LEN
NO_KEY = bytes(KEY_ID_LEN)  # key_id of a file written without a deployment key (its MAC is zeros)
_RESERVED = bytes(24)
KIND_CODES = {GroupKind.FULL_ATTENTION: 1, GroupKind.SLIDING_WINDOW: 2, GroupKind.CHUNKED_LOCAL: 3, GroupKind.MAMBA: 4}



def file_bytes(payload_len: int) -> int:
    """The size of a chunk file (or object) whose payload is `payload_len` bytes: what a plan
    or a tool outside the stores asks, rather than adding `HEADER_LEN` itself."""
    return HEADER_LEN + payload_len

class FormatError(ValueError):
    """A file that is not exactly the chunk that was asked for."""


def header_of(raw: bytes, size: int) -> ChunkHeader:
    """The header of a chunk file or object of `size` bytes from its first bytes `raw`: the one
    reader of a header that the stores and the tools share. FormatError: shorter than a header, or
    not a header of ours; whether `size` fits it is `ChunkHeader.size_problem`."""
    if len(raw) < HEADER_LEN:
        raise FormatError(f"{size} bytes: shorter than the {HEADER_LEN}-byte header")
    return ChunkHeader.unpack(raw[:HEADER_LEN])


@dataclass(frozen=True)
class ChunkHeader:
    fingerprint: Fingerprint
    key: ChunkKey
    group: int
    kind: GroupKind
    token_start: int
    token_end: int
    num_pages: int
    page_bytes: int
    payload_crc: int = 0
    # First 8 bytes of the parent entry's key: the previous chunk's, or for an
    # attention-only tail entry past its chunk's first unit the tail entry
    # ending where it starts (zeros for chunk 0, or unknown). Not identity
    # (the key already covers the prefix); it lets eviction and tools such as
    # `kvoffload gc` find an entry's descendants without the prompts.
    parent: bytes = bytes(8)
    # The deployment key that signed the file (offload/store/auth.py: derived
    # from the key, reveals nothing of it), and the keyed BLAKE3 MAC over
    # header bytes [0, MAC_OFFSET) and the payload; zeros without a key.
    key_id: bytes = NO_KEY
    mac: bytes = bytes(MAC_LEN)
    # In memory only, never in the file: the whole key of the parent entry, for
    # a writer that must not land an entry behind a hole (None: unknown, or none).
    parent_key: bytes | None = field(default=None, compare=False)

    @property
    def payload_len(self) -> int:
        return self.num_pages * self.page_bytes

    def size_problem(self, size: int) -> str | None:
        """Why a file or object of `size` bytes cannot be this header's entry (truncated or
        extended), or None."""
        want = file_bytes(self.payload_len)
        return None if size == want else f"size {size} bytes, header says {want} (truncated?)"

    def pack(self) -> bytes:
        from offload.copier import crc32c

        body = _STRUCT.pack(
            MAGIC, FORMAT_VERSION, HEADER_LEN, self.group, KIND_CODES[self.kind], self.fingerprint,
            self.key, self.token_start, self.token_end, self.num_pages, self.page_bytes,
            self.payload_len, self.payload_crc, self.parent, self.key_id, _RESERVED, self.mac, 0,
        )
        return body[:-4] + struct.pack("<I", crc32c(body[:-4]))

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkHeader:
        from offload.copier import crc32c

        if len(raw) != HEADER_LEN:
            raise FormatError(f"header is {len(raw)} bytes, expected {HEADER_LEN}")
        (magic, version, hlen, group, kind, fp, key, t0, t1, npages, pbytes, plen, pcrc, parent, key_id, reserved, mac,
         hcrc) = _STRUCT.unpack(raw)
        if magic != MAGIC:
            raise FormatError("bad magic: not a kvoffload chunk file")
        if version != FORMAT_VERSION:
            raise FormatError(f"format version {version}, this build reads {FORMAT_VERSION}")
        if hlen != HEADER_LEN or crc32c(raw[:-4]) != hcrc:
            raise FormatError("header checksum mismatch")
        kinds = {v: k for k, v in KIND_CODES.items()}
        if kind not in kinds or plen != npages * pbytes or reserved != _RESERVED:
            raise FormatError("inconsistent header fields")
        return cls(Fingerprint(fp), ChunkKey(key), group, kinds[kind], t0, t1, npages, pbytes, pcrc, parent,
                   key_id, mac)

    @staticmethod
    def peek_parent(raw: bytes) -> tuple[bytes | None, bool]:
        """(parent key prefix, is Mamba) from a header's raw bytes, without
        verifying it (for eviction ordering, which must not cost a checksum
        per file): None when the entry stands alone (Mamba, chunk 0, or a
        header too short to say)."""
        if len(raw) < HEADER_LEN:
            return None, True
        fields = _STRUCT.unpack(raw[:HEADER_LEN])
        kind, parent = fields[4], fields[13]
        mamba = kind == KIND_CODES[GroupKind.MAMBA]
        return (None if mamba or parent == bytes(8) else parent), mamba

    def check_matches(self, expected: ChunkHeader) -> None:
        """Every identity field must equal what the reader asked for."""
        for f in ("fingerprint", "key", "group", "kind", "token_start", "token_end", "num_pages", "page_bytes"):
            if getattr(self, f) != getattr(expected, f):
                raise FormatError(f"header field {f} does not match the requested chunk")

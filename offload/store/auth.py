"""The deployment key: who may write cache entries that this deployment loads.

A chunk's CRC-32C catches accidents; it does not stop anyone who can write the
cache directory (or the Redis remote) from planting a file under a name they
can compute from a prompt. With a key, every entry carries a MAC over its
payload and its header (identity fields included), so only a holder of the
key can make an entry this deployment restores, and a valid entry copied
under another name is refused too. See docs/reliability.md (threat model)
and docs/format.md (header fields `key_id`, `mac`).

Two MAC constructions, told apart by the key id (each derived with its own
context, so a reader that knows only one never mistakes the other for a
forgery): v2 signs (AES-256-GMAC under a one-entry key: 28 GB/s on one core
where AES and carry-less multiply are in the CPU, so a MAC costs about what
the CRC does); v1, keyed BLAKE3 (7-8 GB/s), is still verified, so entries
signed before v2 keep loading.

The key is configured by reference only (a file path or an environment
variable's name) and never leaves this module: `Keyring` holds derived keys,
not the secret, and its repr shows key ids only. A key id is derived from the
secret separately (BLAKE3's derive_key mode with its own context), so it names
a key without revealing anything about it.
"""

from __future__ import annotations

import hmac
import os
import stat

import blake3
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from offload.copier import Ghash
from offload.store.base import OptionError, PayloadMac
from offload.store.format import MAC_LEN, MAC_OFFSET, NO_KEY, ChunkHeader, FormatError
from offload.store.options import AuthRef  # the tier option lives with the others; imported from here too

MIN_SECRET_BYTES = 32
# BLAKE3 derive_key contexts: globally unique, fixed for the life of the format.
MAC_CONTEXT = "kvoffload 2026-11-25 chunk MAC key v1"
KEY_ID_CONTEXT = "kvoffload 2026-11-25 key id v1"
GMAC_CONTEXT = "kvoffload 2026-11-28 chunk GMAC key v2"
GMAC_KEY_ID_CONTEXT = "kvoffload 2026-11-28 key id v2"
# v2's MAC field: a random nonce (it picks the entry's own AES key), then the GMAC tag.
NONCE_LEN = 16
TAG_LEN = MAC_LEN - NONCE_LEN
_GCM_IV = bytes(12)  # each entry key signs one entry, so a fixed IV never repeats under a key
_J0_COUNTER = (1).to_bytes(4, "big")  # GCM's J0 for a 96-bit IV: IV || 0^31 || 1
# Text, not raw bytes: a trailing CR/LF is stripped from a key file, so 32 raw random bytes
# would come up short once in 128 keys.
KEY_HINT = "e.g. 'openssl rand -base64 48 > FILE && chmod 600 FILE'"


class KeyConfigError(ValueError):
    """A key reference that cannot be used; the message names the config
    field and the file or variable, never the key."""


class Unauthenticated(Exception):
    """An entry this deployment must not load: no MAC, another deployment's
    key, a MAC that does not verify, or a valid MAC on another chunk's entry.
    `quarantine`: the entry claims our key (a forgery or a copy), so a file is
    moved aside; one of another key is another deployment's and left alone."""

    def __init__(self, detail: str, quarantine: bool) -> None:
        super().__init__(detail)
        self.quarantine = quarantine


class Mac:
    """One entry's MAC in progress: `update` with the payload, then the
    header's MAC-covered bytes; then `field()` (a signer's MAC field) or
    `verify(field)`. Large updates run without the GIL. `ghash`, where not
    None, is the hash state the copier may feed in its own pass over the
    payload (`copier.crc32c_ghash`, `GroupPages.scatter(ghash=)`) in place of
    `update`."""

    ghash: Ghash | None = None

    def update(self, data) -> None:
        raise NotImplementedError

    def field(self) -> bytes:
        raise NotImplementedError

    def verify(self, field: bytes) -> bool:
        return hmac.compare_digest(self.field(), field)


class _Blake3Mac(Mac):
    __slots__ = ("_h",)

    def __init__(self, mac_key: bytes) -> None:
        self._h = blake3.blake3(key=mac_key)

    def update(self, data) -> None:
        self._h.update(data)

    def field(self) -> bytes:
        return self._h.digest()


class _GmacMac(Mac):
    """GMAC (GCM's tag with everything as associated data) under a key of this
    entry alone, BLAKE3-derived from the deployment's GMAC key and the
    entry's random nonce: no IV is ever reused under a key, so no bound on
    the number of entries a key signs. Where the copier hashes
    (`copier.ghash_available`: AVX-512 VPCLMULQDQ) the GHASH runs there, fed
    in the pass that moves or CRCs the bytes, and only the AES (the hash key
    H = AES_K(0) and the tag mask AES_K(J0)) is cryptography's; the tag is
    GCM's either way."""

    __slots__ = ("_enc", "_mask", "_nonce", "ghash")

    def __init__(self, gmac_key: bytes, nonce: bytes) -> None:
        from offload.copier import Ghash, ghash_available

        self._nonce = nonce
        entry_key = blake3.blake3(nonce, key=gmac_key).digest()
        if ghash_available():
            aes = Cipher(algorithms.AES(entry_key), modes.ECB()).encryptor()
            h_and_mask = aes.update(bytes(16) + _GCM_IV + _J0_COUNTER)
            self.ghash, self._mask, self._enc = Ghash(h_and_mask[:16]), h_and_mask[16:], None
        else:
            self.ghash, self._mask = None, b""
            self._enc = Cipher(algorithms.AES(entry_key), modes.GCM(_GCM_IV)).encryptor()

    def update(self, data) -> None:
        if self.ghash is not None:
            self.ghash.update_buffer(data)
        else:
            assert self._enc is not None
            self._enc.authenticate_additional_data(data)

    def field(self) -> bytes:
        if self.ghash is not None:
            s = int.from_bytes(self.ghash.digest(), "big") ^ int.from_bytes(self._mask, "big")
            return self._nonce + s.to_bytes(16, "big")
        assert self._enc is not None
        self._enc.finalize()
        return self._nonce + self._enc.tag


class _Key:
    """One derived MAC key and its id; the secret itself is not kept.
    `version` 2 (GMAC) signs; version 1 (keyed BLAKE3) only verifies."""

    __slots__ = ("_mac_key", "key_id", "version")

    def __init__(self, secret: bytes, version: int = 2) -> None:
        if version not in (1, 2):
            raise ValueError(f"MAC version {version}")
        self.version = version
        id_ctx, key_ctx = (KEY_ID_CONTEXT, MAC_CONTEXT) if version == 1 else (GMAC_KEY_ID_CONTEXT, GMAC_CONTEXT)
        self.key_id = blake3.blake3(secret, derive_key_context=id_ctx).digest(length=len(NO_KEY))
        self._mac_key = blake3.blake3(secret, derive_key_context=key_ctx).digest()

    def start(self, field: bytes | None = None) -> Mac:
        """A MAC to sign a new entry (`field` None) or to verify one whose MAC field is `field`."""
        if self.version == 1:
            return _Blake3Mac(self._mac_key)
        return _GmacMac(self._mac_key, os.urandom(NONCE_LEN) if field is None else field[:NONCE_LEN])

    def __repr__(self) -> str:
        return f"<key id {self.key_id.hex()}>"

    def __reduce__(self):
        raise TypeError("a deployment key is not picklable")


def _as_buffer(payload):
    """A zero-copy buffer of a uint8 CPU tensor (or bytes-like as is)."""
    numpy = getattr(payload, "numpy", None)
    return payload.numpy() if numpy is not None else payload


def _crc_and_feed(payload, mac: Mac, crc: int | None = None) -> int:
    """CRC-32C of `payload` (`crc` where the caller's copy took it), and `mac` fed the same
    bytes, without the GIL: in one pass where the copier hashes for the MAC (each piece CRC'd
    and hashed from cache), else two calls over the whole payload (a walk in cache-sized blocks
    from here held the GIL once per block, which slowed every other store thread)."""
    import torch

    from offload.copier import crc32c, crc32c_ghash

    if crc is None and mac.ghash is not None and isinstance(payload, torch.Tensor):
        return crc32c_ghash(payload, mac.ghash)
    if crc is None:
        crc = crc32c(payload)
    mac.update(_as_buffer(payload))
    return crc


class Keyring:
    """The current key (signs new entries) and previous keys (verify only).
    Each secret gives a v2 key (signs) and a v1 key (verifies entries signed
    before v2). Thread-safe (immutable); both MACs release the GIL while they
    hash a large buffer, so I/O threads MAC in parallel."""

    __slots__ = ("_by_id", "current")

    def __init__(self, current: bytes, previous: tuple[bytes, ...] = ()) -> None:
        keys = [_Key(current), *(_Key(p) for p in previous), *(_Key(k, version=1) for k in (current, *previous))]
        if any(k.key_id == NO_KEY for k in keys):  # 2^-64: a key whose id reads as "no key"
            raise KeyConfigError("auth: this key's id is all zeros; generate another key")
        self.current = keys[0]
        self._by_id: dict[bytes, _Key] = {}
        for k in keys:
            self._by_id.setdefault(k.key_id, k)

    @classmethod
    def merged(cls, rings: list[Keyring]) -> Keyring:
        """One keyring holding every key of `rings` (the first ring's current key signs)."""
        out = object.__new__(cls)
        out.current = rings[0].current
        out._by_id = {}
        for r in rings:
            for k, v in r._by_id.items():
                out._by_id.setdefault(k, v)
        return out

    @property
    def key_ids(self) -> tuple[bytes, ...]:
        """The ids of the keys as they sign now (v2), one per secret; v1 ids are verified too, not listed."""
        return tuple(k for k, v in self._by_id.items() if v.version == 2)

    def key(self, key_id: bytes) -> _Key | None:
        return self._by_id.get(key_id)

    def begin(self) -> Mac:
        """A MAC to sign a new entry with (the current key), for a copy of the payload to feed in
        its own pass (its `ghash`, where not None) before `sign(fed=)`."""
        return self.current.start()

    def sign(self, header: ChunkHeader, payload, crc: int | None = None,
             fed: PayloadMac | None = None) -> ChunkHeader:
        """`header` with the payload's CRC (`crc` where the caller has it), this deployment's key
        id and the MAC (one pass over the payload; none where `fed`, a MAC from `begin` whose hash
        a copy fed the payload, comes with the copy's `crc`)."""
        mac: PayloadMac
        if fed is not None and crc is not None:
            mac = fed
        else:
            mac = self.current.start()
            crc = _crc_and_feed(payload, mac, crc)
        h = ChunkHeader(**{**header.__dict__, "payload_crc": crc, "key_id": self.current.key_id,
                           "mac": bytes(MAC_LEN)})
        mac.update(h.pack()[:MAC_OFFSET])
        return ChunkHeader(**{**h.__dict__, "mac": mac.field()})

    def __repr__(self) -> str:
        prev = [k.hex() for k in self.key_ids if k != self.current.key_id]
        return f"Keyring(current={self.current.key_id.hex()}, previous={prev})"

    def __reduce__(self):
        raise TypeError("a deployment key is not picklable")


def frame(header: ChunkHeader, payload, keyring: Keyring | None, crc: int | None = None,
          fed: PayloadMac | None = None) -> bytes:
    """The header bytes a writer puts in front of `payload`: its CRC-32C (`crc`
    where the copy that filled the buffer took it) and, with a keyring, the
    current key's id and MAC (`fed`: begun by `keyring.begin` and fed the
    payload by that copy). Without one, `header`'s own `key_id` and `mac` are
    kept (zeros unless a caller set them)."""
    if keyring is not None:
        return keyring.sign(header, payload, crc, fed).pack()
    from offload.copier import crc32c

    return ChunkHeader(**{**header.__dict__, "payload_crc": crc32c(payload) if crc is None else crc}).pack()


def check_entry(raw: bytes, crc: int | None, expected: ChunkHeader, payload,
                keyring: Keyring | None, crc_later: bool = False) -> ChunkHeader:
    """Verify an entry read as header bytes `raw` and `payload` (whose CRC-32C
    is `crc`, or None: computed here when needed) against the chunk asked for.
    Raises FormatError (damage: an accident) or Unauthenticated (no key of
    ours vouches for it). Order: the header's own checks; then, with a
    keyring, the key id (not ours: left alone), the MAC (when it fails, the
    payload CRC tells an accident, `corrupt`, from a forgery), and the
    identity (a valid MAC on another chunk's entry is a copy: refused as
    unauthenticated); without one, identity and CRC as always. A valid MAC
    implies the CRC: the signer wrote the CRC of the bytes it signed, and the
    MAC covers both, so the CRC is not computed then (a load with a key reads
    with `with_crc=False`). `crc_later` (no keyring only): everything but the payload CRC,
    which the caller compares with the returned header's `payload_crc` in its own pass."""
    return begin_entry(raw, crc, expected, payload, keyring, crc_later and keyring is None)[0]


def begin_entry(raw: bytes, crc: int | None, expected: ChunkHeader, payload, keyring: Keyring | None,
                later: bool) -> tuple[ChunkHeader, Mac | None]:
    """`check_entry`, except that with `later` what the caller's own pass
    over the payload can take is left to it: without a keyring the CRC
    (compared with the returned header's `payload_crc`), with one the MAC
    where the copier hashes for it (the returned Mac: feed its `ghash` the
    payload, then `close_entry`). Returns (header, that Mac or None)."""
    header, mac = open_entry(raw, expected, keyring)
    if later and (mac is None or mac.ghash is not None):
        return header, mac
    if mac is not None:
        mac.update(_as_buffer(payload))
    close_entry(raw, header, expected, payload, crc, mac)
    return header, None


def open_entry(raw: bytes, expected: ChunkHeader, keyring: Keyring | None) -> tuple[ChunkHeader, Mac | None]:
    """The checks of `check_entry` that need no payload: the header, then
    without a keyring its identity; with one, the key id. Returns the header
    and, with a keyring, its MAC started: feed it the payload, then
    `close_entry`."""
    header = ChunkHeader.unpack(raw)
    if keyring is None:
        header.check_matches(expected)
        return header, None
    if header.key_id == NO_KEY:
        raise Unauthenticated("no MAC (written without a deployment key)", quarantine=False)
    key = keyring.key(header.key_id)
    if key is None:
        raise Unauthenticated(f"key id {header.key_id.hex()} is not one of this deployment's keys", quarantine=False)
    return header, key.start(header.mac)


def close_entry(raw: bytes, header: ChunkHeader, expected: ChunkHeader, payload, crc: int | None,
                mac: PayloadMac | None) -> None:
    """The rest of `check_entry` once `mac` (from `open_entry`) has been fed
    the payload: the MAC, then the identity; without a MAC, the CRC."""
    from offload.copier import crc32c

    if mac is None:
        if header.payload_crc != (crc32c(payload) if crc is None else crc):
            raise FormatError("payload checksum mismatch")
        return
    mac.update(raw[:MAC_OFFSET])
    if not mac.verify(header.mac):
        if header.payload_crc != (crc32c(payload) if crc is None else crc):
            raise FormatError("payload checksum mismatch")
        raise Unauthenticated(f"MAC mismatch under key id {header.key_id.hex()}", quarantine=True)
    try:
        header.check_matches(expected)
    except FormatError as e:
        raise Unauthenticated(f"valid MAC, but {e} (an entry copied under another name)", quarantine=True) from None


# ---- loading keys by reference -----------------------------------------------------------


def _file_secret(name: str, path: str) -> bytes:
    fix = f"run 'chmod 600 {path}'"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyConfigError(f"{name}={path!r}: no such file; create the key file ({KEY_HINT})") from None
    except OSError as e:
        raise KeyConfigError(f"{name}={path!r}: cannot open the key file ({e.strerror}); it must be readable by "
                             "the user the engine runs as, and by no one else") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyConfigError(f"{name}={path!r}: not a regular file")
        if st.st_mode & 0o077:
            raise KeyConfigError(f"{name}={path!r}: mode {stat.S_IMODE(st.st_mode):04o} gives group or others "
                                 f"access to the key; {fix} (owner only)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(1 << 16)
    finally:
        os.close(fd)
    return data.rstrip(b"\r\n")


def _env_secret(name: str, var: str) -> bytes:
    value = os.environ.get(var)
    if value is None:
        raise KeyConfigError(f"{name}={var!r}: the environment variable {var} is not set; it must hold the key "
                             f"(at least {MIN_SECRET_BYTES} bytes, {KEY_HINT})")
    return value.encode()


def _secret(name: str, data: bytes) -> bytes:
    if len(data) < MIN_SECRET_BYTES:
        raise KeyConfigError(f"{name}: the key is {len(data)} bytes, at least {MIN_SECRET_BYTES} are needed "
                             f"({KEY_HINT})")
    return data


def load_keyring(ref: AuthRef) -> Keyring:
    """Read the keys `ref` names; KeyConfigError naming the field (never the key) if one cannot be used."""
    f = ref.field
    if (ref.key_file is None) == (ref.key_env is None):
        raise KeyConfigError(f"{f}: give exactly one of key_file (a file holding the key) or key_env (the name of "
                             "an environment variable holding it)")
    if ref.key_file is not None:
        current = _secret(f"{f}.key_file", _file_secret(f"{f}.key_file", ref.key_file))
    else:
        assert ref.key_env is not None
        current = _secret(f"{f}.key_env", _env_secret(f"{f}.key_env", ref.key_env))
    previous = [_secret(f"{f}.previous_key_files[{i}]", _file_secret(f"{f}.previous_key_files[{i}]", p))
                for i, p in enumerate(ref.previous_key_files)]
    previous += [_secret(f"{f}.previous_key_envs[{i}]", _env_secret(f"{f}.previous_key_envs[{i}]", v))
                 for i, v in enumerate(ref.previous_key_envs)]
    return Keyring(current, tuple(previous))


def open_keyring(ref: AuthRef | None) -> Keyring | None:
    """The keys `ref` names (None without it); OptionError naming the option otherwise."""
    if ref is None:
        return None
    try:
        return load_keyring(ref)
    except KeyConfigError as e:
        raise OptionError(str(e)) from None

"""The deployment key on real vLLM engines (docs/reliability.md, threat model).

Files (the toy hybrid, default suite): engine 1 (key K1, a key file) serves
prompts A..G cold (the reference: our connector loaded, nothing restored),
then the test tampers with the cache as a writer without the key could:
A's attention file replaced by a planted one (valid header and CRC, attacker
payload, the right name, no MAC), E's forged under our key id (payload and CRC
replaced, the old MAC), B's and C's swapped (two valid files), D's replaced by
a copy of B's (a valid file under another prompt's name). Pass 2: every
tampered prompt's load fails as `unauthenticated`, outputs stay identical, F
restores; pass 3: the quarantined ones were stored again and restore, A's
planted file (not ours: left alone) still does not. Engine 2, a restart with a
rotated key (K2 from an environment variable, K1 as a previous key), restores
what K1 wrote, misses on G's files that the test re-signed with a key it does
not have (K3: a wrong key gives misses, no failed request), and restores what
it wrote itself with K2. The LMCache tier's Redis remote gets the same
treatment. Every engine's log and the test's captured output are searched for
every key (raw, hex, base64) and the MAC keys derived from them.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import random
import time
from pathlib import Path

import blake3
import pytest
import torch

from conftest import CHUNK, engine_args, fs_kv_config, layouts, random_prompt
from harness.client import wait_until
from harness.engine import EngineRun, RunSpec, start_engine
from offload.keys import chunk_keys, request_root
from offload.planner import GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.auth import GMAC_CONTEXT, GMAC_KEY_ID_CONTEXT, MAC_CONTEXT, Keyring, frame
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.format import HEADER_LEN, NO_KEY, ChunkHeader

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

KEY_ENV = "KVOFFLOAD_TEST_DEPLOYMENT_KEY"


def new_secret() -> str:
    """A key as an operator would make one: `openssl rand -base64 36` (48 characters)."""
    return base64.b64encode(os.urandom(36)).decode()


def key_id(secret: bytes) -> bytes:
    return blake3.blake3(secret, derive_key_context=GMAC_KEY_ID_CONTEXT).digest(length=8)


def leaks(text: str, secrets: list[bytes]) -> list[str]:
    """Which forms of which key occur in `text`: raw, hex, base64 of the secret and the derived MAC key."""
    found = []
    for i, s in enumerate(secrets):
        v1, v2 = (blake3.blake3(s, derive_key_context=c).digest() for c in (MAC_CONTEXT, GMAC_CONTEXT))
        for what, form in (("raw", s), ("hex", s.hex().encode()), ("base64", base64.b64encode(s)),
                           ("derived hex", v1.hex().encode()), ("derived base64", base64.b64encode(v1)),
                           ("derived v2 hex", v2.hex().encode()), ("derived v2 base64", base64.b64encode(v2))):
            if form.decode("latin-1") in text:
                found.append(f"key {i} ({what})")
    return found


def write_key(path: Path, secret: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return str(path)


def group_kinds(cache: Path) -> list[GroupKind]:
    """Each group's kind, from layout.json (as `kvoffload fsck` reads it)."""
    from offload.cli.cache import FpDir

    [(dirname, lay)] = list(layouts(cache).items())
    kinds = FpDir(cache / LAYOUT_DIR / dirname, layout=lay).layout_kinds()
    return [kinds[g] for g in range(len(lay["groups"]))]


def files_per_load(cache: Path, chunk: int, hit: int) -> int:
    """Files a load of a `hit`-token prefix reads: what the planner says each group needs."""
    kinds = group_kinds(cache)
    planner = HybridOffloadPlanner([GroupSpec(k, chunk, 1, 1) for k in kinds], chunk)
    return sum(len(planner.needed(g, hit // chunk)) for g in range(len(kinds)))


def file_of(cache: Path, prompt: list[int], group: int, chunk: int, chunk_size: int = CHUNK) -> Path:
    [(dirname, lay)] = list(layouts(cache).items())
    key = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, chunk_size)[chunk]
    return cache / LAYOUT_DIR / dirname / f"g{group}" / key.hex()[:2] / f"{key.hex()}.kv"


def reframe(raw: bytes, payload: bytes | None = None, keyring: Keyring | None = None, **fields) -> bytes:
    """A chunk entry rebuilt as a writer would: `payload` (default: the old one) with its CRC,
    header `fields` changed, signed with `keyring` (None: no MAC, unless `fields` set one)."""
    h = ChunkHeader.unpack(raw[:HEADER_LEN])
    body = raw[HEADER_LEN:] if payload is None else payload
    h = dataclasses.replace(h, **({"key_id": NO_KEY, "mac": bytes(32)} if keyring is None and not fields else {}),
                            **fields)
    t = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return frame(h, t, keyring) + body


def replace_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tamper")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def stop(*runs: EngineRun) -> None:
    for r in runs:
        if r.proc.poll() is None:
            r.kill()


# ---- files -------------------------------------------------------------------------------------

NAMES = "ABCDEFGH"


def _fs(models_dir: Path, tmp: Path, model: str = "qwen3-next-tiny", chunk: int = CHUNK,
        args: dict | None = None, n_tokens: int = 300, names: str = NAMES) -> dict:
    rng = random.Random(24)
    prompts = {n: random_prompt(rng, n_tokens) for n in names} | {"Z": random_prompt(rng, 60)}
    order = list(prompts)
    ix = {n: i for i, n in enumerate(order)}
    s1, s2 = new_secret(), new_secret()
    k3 = os.urandom(48)
    k1_file = write_key(tmp / "keys" / "k1", s1)
    cache = tmp / "cache"
    args = args or engine_args(True)
    kv1 = fs_kv_config(cache, auth={"key_file": k1_file})
    kv2 = fs_kv_config(cache, auth={"key_env": KEY_ENV, "previous_key_files": [k1_file]})
    cold = [ix[n] for n in names if n != "H"]
    again = [ix[n] for n in names if n not in "GH"]
    spec1 = RunSpec(str(models_dir / model), list(prompts.values()), kv1, 12, args, order=[cold, again, again],
                    gated=True)
    spec2 = RunSpec(str(models_dir / model), list(prompts.values()), kv2, 12, args,
                    order=[[ix["Z"]], [ix["F"], ix["B"], ix["G"], ix["H"]], [ix["H"]]], gated=True)
    t0 = time.monotonic()
    # Engine 2 starts beside engine 1 (a start is mostly imports) and waits, gated, after a warm-up prompt.
    e1 = start_engine(spec1, workdir=tmp / "e1")
    e2 = start_engine(spec2, env={KEY_ENV: s2}, workdir=tmp / "e2")
    out: dict = {"prompts": prompts, "ix": ix, "cache": cache, "secrets": [s1.encode(), s2.encode(), k3]}
    try:
        e1.wait_pass(0, timeout_s=1200)
        kinds = group_kinds(cache)
        attn = kinds.index(GroupKind.FULL_ATTENTION)
        f = {n: file_of(cache, prompts[n], attn, 0, chunk) for n in "ABCDE"}
        orig = {n: f[n].read_bytes() for n in "ABCDE"}
        # A: planted by a writer without the key: the right name, a valid header and CRC, its own payload.
        attacker = bytes(random.Random(7).randrange(256) for _ in range(len(orig["A"]) - HEADER_LEN))
        planted = reframe(orig["A"], attacker)
        replace_file(f["A"], planted)
        # E: forged under our key id: payload and CRC replaced, the MAC left as it was.
        old = ChunkHeader.unpack(orig["E"][:HEADER_LEN])
        replace_file(f["E"], reframe(orig["E"], attacker, key_id=old.key_id, mac=old.mac))
        # B and C swapped; D replaced by a copy of B's.
        replace_file(f["B"], orig["C"])
        replace_file(f["C"], orig["B"])
        replace_file(f["D"], orig["B"])
        out["planted"], out["planted_path"] = planted, f["A"]
        out["tampered_names"] = {f[n].name for n in "BCDE"}
        e1.release(1)
        e1.wait_pass(1, timeout_s=1200)
        out["quarantine_after_pass2"] = sorted(p.name for p in (f["A"].parents[2] / "quarantine").iterdir())
        e1.release(2)
        out["e1"] = e1.wait(timeout_s=1200)
        # G: re-signed with a key that engine 2 does not have (another deployment's).
        ring3 = Keyring(k3)
        out["g_files"] = [p for g in range(len(kinds)) for c in (0, 1)
                          if (p := file_of(cache, prompts["G"], g, c, chunk)).exists()]
        for p in out["g_files"]:
            replace_file(p, reframe(p.read_bytes(), keyring=ring3))
        out["g_bytes"] = [p.read_bytes() for p in out["g_files"]]
        out["quarantine_before_e2"] = len(list((f["A"].parents[2] / "quarantine").iterdir()))
        e2.wait_pass(0, timeout_s=1200)
        e2.release(1)
        e2.wait_pass(1, timeout_s=1200)
        e2.release(2)
        out["e2"] = e2.wait(timeout_s=1200)
        out["h_file"] = file_of(cache, prompts["H"], attn, 0, chunk).read_bytes()[:HEADER_LEN]
        out["files_per_load"] = files_per_load(cache, chunk, (n_tokens - 1) // chunk * chunk)
        out["quarantine_after_e2"] = len(list((f["A"].parents[2] / "quarantine").iterdir()))
        out["s"] = time.monotonic() - t0
        return out
    finally:
        stop(e1, e2)


def check_fs(r: dict, hit: int) -> None:
    ix, e1, e2 = r["ix"], r["e1"], r["e2"]
    p0, p1, p2 = e1.by_pass(0), e1.by_pass(1), e1.by_pass(2)
    ref = {n: p0[ix[n]].output_ids for n in "ABCDEFG"}
    assert all(res.restored_tokens == 0 for res in p0.values()), "pass 1 of a cold engine restores nothing"
    # Pass 2: every tampered prompt is a miss and a recompute (identical tokens); the untouched F restores.
    for n in "ABCDE":
        assert p1[ix[n]].load_failed and p1[ix[n]].output_ids == ref[n], n
    assert p1[ix["F"]].restored_tokens == hit and not p1[ix["F"]].load_failed and p1[ix["F"]].output_ids == ref["F"]
    # Those claiming our key went to quarantine; A's planted file (no MAC: not ours) was left alone.
    assert {q.rsplit(".", 1)[0] for q in r["quarantine_after_pass2"]} == r["tampered_names"]
    assert len(r["quarantine_after_pass2"]) == 4
    assert r["planted_path"].read_bytes() == r["planted"], "the planted file is left as it was"
    # Pass 3: B..F were stored again after their recompute and restore; A still cannot.
    for n in "BCDEF":
        assert p2[ix[n]].restored_tokens == hit and not p2[ix[n]].load_failed and p2[ix[n]].output_ids == ref[n], n
    assert p2[ix["A"]].load_failed and p2[ix["A"]].output_ids == ref["A"]
    fs = {"tier": "fs"}
    assert e1.metric("kvoffload_failed_loads_total", reason="unauthenticated", **fs) == 6  # A-E, then A
    assert e1.metric("kvoffload_failed_loads_total", **fs) == 6, "no other failed loads"
    assert e1.metric("kvoffload_chunk_misses_total", reason="unauthenticated", **fs) == 6
    assert e1.metric("kvoffload_chunk_misses_total", reason="corrupt", **fs) == 0
    # Engine 2 (restart, K2 current, K1 previous): what K1 wrote restores; G (K3) misses, no failed request.
    q1, q2 = e2.by_pass(1), e2.by_pass(2)
    for n in "FB":
        assert q1[ix[n]].restored_tokens == hit and not q1[ix[n]].load_failed and q1[ix[n]].output_ids == ref[n], n
    g = q1[ix["G"]]
    assert g.load_failed and g.output_ids == ref["G"] and len(g.output_ids) == 12
    assert [p.read_bytes() for p in r["g_files"]] == r["g_bytes"], "another key's files are left alone"
    assert r["quarantine_after_e2"] == r["quarantine_before_e2"]
    assert e2.metric("kvoffload_failed_loads_total", reason="unauthenticated", **fs) == 1
    assert e2.metric("kvoffload_failed_loads_total", **fs) == 1
    # Every file of G's load failed (all of G's files were re-signed): as many as the planner reads for a hit.
    assert e2.metric("kvoffload_chunk_misses_total", reason="unauthenticated", **fs) == r["files_per_load"]
    # H: stored by engine 2 under K2, restored in its next pass.
    assert q1[ix["H"]].restored_tokens == 0 and q2[ix["H"]].restored_tokens == hit
    assert q2[ix["H"]].output_ids == q1[ix["H"]].output_ids
    assert ChunkHeader.unpack(r["h_file"]).key_id == key_id(r["secrets"][1])


def check_no_key_in(texts: list[str], secrets: list[bytes]) -> None:
    for t in texts:
        assert not leaks(t, secrets), leaks(t, secrets)


def _fs_runs(models_dir, tmp_path):
    return _fs(models_dir, tmp_path)


@pytest.mark.prefetch.with_args(_fs_runs)
def test_fs_planted_swapped_copied_wrong_key_and_rotation_on_real_engines(prefetched, capfd):
    r = prefetched(_fs_runs)
    check_fs(r, (300 - 1) // CHUNK * CHUNK)
    captured = capfd.readouterr()
    spec_files = [p.read_text() for p in r["cache"].parent.glob("e*/spec.json")]
    check_no_key_in([r["e1"].log, r["e2"].log, captured.out, captured.err, *spec_files], r["secrets"])
    print(f"auth e2e (files): 2 engines in {r['s']:.0f}s; quarantined {len(r['quarantine_after_pass2'])}")


@pytest.mark.long
def test_fs_authentication_on_the_80b_geometry(models_dir, tmp_path, capfd):
    """The same on the Qwen3-Next-80B per-layer geometry, with the chunk size and flags of its plan."""
    from offload.plan.run import plan_for_model

    model = models_dir / "qwen3-next-80b-geometry"
    plan = plan_for_model(model, max_model_len=4096)
    c = plan.hybrid_chunk_size
    args = {"enable_prefix_caching": True, "max_model_len": 4096, "enforce_eager": True, **plan.engine_kwargs}
    r = _fs(models_dir, tmp_path, "qwen3-next-80b-geometry", c, args, n_tokens=2 * c + 60)
    check_fs(r, 2 * c)
    captured = capfd.readouterr()
    check_no_key_in([r["e1"].log, r["e2"].log, captured.out, captured.err], r["secrets"])


# ---- the LMCache tier's Redis remote ---------------------------------------------------------


def redis_objects(client) -> dict[bytes, bytes]:
    """Every object's Redis data key -> its bytes."""
    from offload.store.lmcache_objects import REDIS_SUFFIXES

    keys = client.keys(b"kvoffload-k1@*" + REDIS_SUFFIXES[0].encode())
    return {k: client.get(k) for k in keys}


def new_objects(client, seen: set[bytes], n: int, timeout_s: float = 60) -> dict[bytes, bytes]:
    """The remote's objects not in `seen`, once there are `n` of them (the remote is written
    behind), or as they are after `timeout_s` (the caller asserts on how many came)."""
    unseen = lambda: {k: v for k, v in redis_objects(client).items() if k not in seen}
    try:
        wait_until(lambda: len(unseen()) >= n, timeout_s, f"{n} new objects on the remote", interval_s=0.1)
    except TimeoutError:
        pass
    return unseen()


def _redis(models_dir, tmp_path):
    import redis

    from test_e2e_lmcache import remote_cfg
    from test_lmcache_objects import RedisServer

    rng = random.Random(2024)
    names = "PQRSTU"
    prompts = [random_prompt(rng, 300) for _ in names] + [random_prompt(rng, 60)]
    ix = {n: i for i, n in enumerate(names)} | {"Z": len(names)}
    s1, s2 = new_secret(), new_secret()
    k3 = os.urandom(48)
    k1_file = write_key(tmp_path / "keys" / "k1", s1)
    srv = RedisServer(tmp_path)
    srv.start()
    client = redis.Redis.from_url(srv.url)
    out: dict = {"ix": ix, "secrets": [s1.encode(), s2.encode(), k3]}
    e1 = e2 = None
    try:
        t0 = time.monotonic()
        kv1 = remote_cfg(tmp_path / "unused", srv.url)
        kv2 = remote_cfg(tmp_path / "unused", srv.url)
        for kv in (kv1, kv2):  # every state, internal ones too, is given to LMCache: one object per entry
            kv["kv_connector_extra_config"]["state_policy"] = "all"
        kv1["kv_connector_extra_config"]["tiers"][0]["auth"] = {"key_file": k1_file}
        kv2["kv_connector_extra_config"]["tiers"][0]["auth"] = {"key_env": KEY_ENV, "previous_key_files": [k1_file]}
        model = str(models_dir / "qwen3-next-tiny")
        # One prompt per pass, so that the test can tell each prompt's objects (their names are hashes).
        e1 = start_engine(RunSpec(model, prompts, kv1, 12, engine_args(True), order=[[i] for i in range(len(names))],
                                  gated=True), workdir=tmp_path / "e1")
        e2 = start_engine(RunSpec(model, prompts, kv2, 12, engine_args(True),
                                  order=[[ix["Z"]], [ix[n] for n in names]], gated=True),
                          env={KEY_ENV: s2}, workdir=tmp_path / "e2")
        per_prompt: dict[str, dict[bytes, bytes]] = {}
        seen: set[bytes] = set()
        for p, n in enumerate(names):
            e1.wait_pass(p, timeout_s=1200)
            new = new_objects(client, seen, 4)
            assert len(new) == 4, (n, len(new))  # 2 full chunks x (GDN state, attention)
            per_prompt[n] = new
            seen |= set(new)
            if p + 1 < len(names):
                e1.release(p + 1)
        out["e1"] = e1.wait(timeout_s=1200)

        def attn0(n: str) -> tuple[bytes, bytes]:
            [(k, v)] = [(k, v) for k, v in per_prompt[n].items()
                        if ChunkHeader.unpack(v[:HEADER_LEN]).kind is GroupKind.FULL_ATTENTION
                        and ChunkHeader.unpack(v[:HEADER_LEN]).token_start == 0]
            return k, v

        # Files a 2-chunk hit reads, by the planner, for the groups the objects' headers name.
        heads = [ChunkHeader.unpack(v[:HEADER_LEN]) for v in per_prompt["U"].values()]
        kinds = dict(sorted({(h.group, h.kind) for h in heads}))
        planner = HybridOffloadPlanner([GroupSpec(kinds[g], CHUNK, 1, 1) for g in sorted(kinds)], CHUNK)
        out["files_per_load"] = sum(len(planner.needed(g, 2)) for g in range(len(kinds)))

        (kp, vp), (kq, vq), (kr, vr), (ks, _) = (attn0(n) for n in "PQRS")
        attacker = bytes(random.Random(8).randrange(256) for _ in range(len(vp) - HEADER_LEN))
        client.set(kp, reframe(vp, attacker))  # P: planted, no MAC
        client.set(kq, vr)  # Q and R swapped
        client.set(kr, vq)
        client.set(ks, vq)  # S: a copy of Q's under S's name
        for k, v in per_prompt["T"].items():  # T: re-signed with a key engine 2 does not have
            client.set(k, reframe(v, keyring=Keyring(k3)))
        # U: untouched, written with K1: engine 2 restores it with K1 as its previous key.
        e2.wait_pass(0, timeout_s=1200)
        e2.release(1)
        out["e2"] = e2.wait(timeout_s=1200)
        out["planted_kept"] = client.get(kp) == reframe(vp, attacker)
        out["s"] = time.monotonic() - t0
        return out
    finally:
        stop(*(e for e in (e1, e2) if e is not None))
        srv.kill()


@pytest.mark.prefetch.with_args(_redis)
def test_redis_remote_planted_swapped_copied_wrong_key_and_rotation(prefetched, capfd):
    r = prefetched(_redis)
    ix, e1, e2 = r["ix"], r["e1"], r["e2"]
    ref = {n: e1.by_pass(p)[ix[n]].output_ids for p, n in enumerate("PQRSTU")}
    assert e1.restored_tokens == 0
    got = e2.by_pass(1)
    hit = (300 - 1) // CHUNK * CHUNK
    for n in "PQRST":
        assert got[ix[n]].load_failed and got[ix[n]].output_ids == ref[n] and len(got[ix[n]].output_ids) == 12, n
    u = got[ix["U"]]
    assert u.restored_by_tier == {"lmcache": hit} and not u.load_failed and u.output_ids == ref["U"]
    lm = {"tier": "lmcache"}
    assert e2.metric("kvoffload_failed_loads_total", reason="unauthenticated", **lm) == 5
    assert e2.metric("kvoffload_failed_loads_total", **lm) == 5, "no other failed loads"
    # P, Q, R, S one object each; every object T's load reads (all of T's were re-signed).
    assert e2.metric("kvoffload_chunk_misses_total", reason="unauthenticated", **lm) == 4 + r["files_per_load"]
    assert r["planted_kept"], "objects have no quarantine: the planted one stays, a miss every time"
    captured = capfd.readouterr()
    check_no_key_in([e1.log, e2.log, captured.out, captured.err], r["secrets"])
    print(f"auth e2e (Redis): 2 engines in {r['s']:.0f}s")

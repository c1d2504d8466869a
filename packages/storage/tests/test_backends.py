"""Every backend against a real server on loopback: moto (s3://, and oci:// through its S3-compatible path),
gcp-storage-emulator (gs://), Azurite (az://), and a local folder; outages through a fault proxy."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from smalti.storage import (
    BucketNotFoundError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectStore,
    ObjectTooLargeError,
    RetryBudgetExceededError,
    RetryPolicy,
    is_temp_name,
    open_store,
)

OUTAGE_S = 20.0  # how long every fault proxy answers 503 in the outage test (the figure)
KiB = 1 << 10


@dataclass
class Target:
    """One backend under test: ``open(proxy_url=None, **options)`` opens the store at ``url``."""

    name: str
    url: str
    upstream: str | None
    part_size: int
    open: Callable[..., ObjectStore]
    missing_bucket_url: str | None


def _fast_retry(budget_s: float = 30.0) -> RetryPolicy:
    return RetryPolicy(budget_s=budget_s, base_s=0.05, max_delay_s=0.5)


@pytest.fixture(params=["file", "s3", "gs", "az", "oci"])
def target(request, tmp_path, monkeypatch) -> Target:
    return _make_target(request.param, request, tmp_path, monkeypatch)


def _make_target(kind: str, request, tmp_path, monkeypatch) -> Target:
    if kind == "file":
        url = str(tmp_path / "store")
        return Target(kind, url, None, 64 * KiB, lambda proxy=None, **o: open_store(url, **o), None)
    if kind in ("s3", "oci"):
        s3 = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        monkeypatch.setenv("OCI_REGION", "us-ashburn-1")
        url = f"s3://{bucket}/pre" if kind == "s3" else f"oci://{bucket}@testns/pre"
        missing = "s3://no-such-bucket/pre" if kind == "s3" else "oci://no-such-bucket@testns/pre"

        def open_s3(proxy=None, url=url, **options):
            return open_store(url, endpoint_url=proxy or s3.endpoint_url, **options)

        return Target(kind, url, s3.endpoint_url, 5 << 20, open_s3, missing)  # S3's smallest part is 5 MiB
    if kind == "gs":
        gcs = request.getfixturevalue("gcs_server")
        url = f"gs://{request.getfixturevalue('gcs_bucket')}/pre"

        def open_gs(proxy=None, url=url, **options):
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy or gcs.endpoint)
            return open_store(url, **options)

        return Target(kind, url, gcs.endpoint, 256 * KiB, open_gs, "gs://no-such-bucket/pre")
    azurite = request.getfixturevalue("azurite_server")
    url = f"az://{request.getfixturevalue('azure_container')}/pre"

    def open_az(proxy=None, url=url, **options):
        endpoint = f"{proxy}/devstoreaccount1" if proxy else None
        return open_store(url, connection_string=azurite.connection_string(endpoint), **options)

    base = azurite.blob_endpoint.rsplit("/", 1)[0]
    return Target(kind, url, base, 256 * KiB, open_az, "az://no-such-container/pre")


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def test_put_get_ranged_stat_list_delete_round_trip(target):
    store = target.open(retry=_fast_retry())
    data = _payload(100_000)
    store.put_bytes("a/one.bin", data)
    store.put_bytes("a/b/two.bin", b"two")
    store.put_bytes("c.txt", b"")
    assert store.get_bytes("a/one.bin") == data
    assert store.get_bytes("a/one.bin", 10, 20) == data[10:20]
    assert store.get_bytes("a/one.bin", 99_990) == data[99_990:]
    info = store.stat("a/one.bin")
    assert info.key == "a/one.bin" and info.size == 100_000 and info.etag and info.mtime
    assert time.time() - 600 < info.mtime < time.time() + 600
    listing = store.list()
    assert [(i.key, i.size) for i in listing] == [("a/b/two.bin", 3), ("a/one.bin", 100_000), ("c.txt", 0)]
    assert [i.key for i in store.list("a/")] == ["a/b/two.bin", "a/one.bin"]
    assert [i.key for i in store.list("a/b")] == ["a/b/two.bin"]
    # overwrite changes the etag
    store.put_bytes("a/b/two.bin", b"TWO!")
    assert store.get_bytes("a/b/two.bin") == b"TWO!" and store.stat("a/b/two.bin").size == 4
    assert store.exists("c.txt") and not store.exists("nope")
    with pytest.raises(ObjectNotFoundError, match="nope"):
        store.stat("nope")
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("nope")
    store.delete("c.txt")
    store.delete("c.txt")  # deleting what is gone is fine
    store.delete_many(["a/one.bin", "a/b/two.bin", "never-was"])
    assert store.list() == []


def test_multipart_upload_of_a_file_larger_than_the_part_size(target, tmp_path, fault_proxy):
    proxy = fault_proxy(target.upstream) if target.upstream else None
    store = target.open(proxy.url if proxy else None, retry=_fast_retry(), part_size=target.part_size)
    size = target.part_size + 12_345  # two parts
    data = _payload(size, seed=1)
    (tmp_path / "big.bin").write_bytes(data)
    store.put_file(tmp_path / "big.bin", "ckpt/big.bin")
    assert store.stat("ckpt/big.bin").size == size
    assert store.get_bytes("ckpt/big.bin") == data
    assert store.get_bytes("ckpt/big.bin", target.part_size - 5, target.part_size + 5) == data[
        target.part_size - 5 : target.part_size + 5]
    if proxy is not None:  # it went up in parts: one request per part at least
        uploads = [r for r in proxy.requests if r[0] in ("PUT", "POST")]
        assert len(uploads) >= 2, uploads


def test_get_file_is_atomic_and_a_rejected_download_leaves_nothing(target, tmp_path):
    store = target.open(retry=_fast_retry())
    data = _payload(300_000, seed=2)
    store.put_bytes("shard.mds", data)
    local = tmp_path / "cache" / "shard.mds"
    seen = []

    def check(tmp):
        seen.append(tmp)
        assert not local.exists()  # nothing at the final name until the check passed
        assert tmp.parent == local.parent and is_temp_name(tmp.name) and tmp.read_bytes() == data

    assert store.get_file("shard.mds", local, check=check) == local
    assert local.read_bytes() == data and seen
    assert os.listdir(local.parent) == ["shard.mds"]

    def reject(tmp):
        raise ValueError("hash mismatch")

    other = tmp_path / "cache" / "again.mds"
    with pytest.raises(ValueError, match="hash mismatch"):
        store.get_file("shard.mds", other, check=reject)
    assert os.listdir(local.parent) == ["shard.mds"]  # no partial file, no temp file
    with pytest.raises(ObjectNotFoundError):
        store.get_file("missing.mds", other)
    assert os.listdir(local.parent) == ["shard.mds"]
    # a check that fails once (a transfer corrupted on the way) is answered by downloading again
    calls = []

    def flaky(tmp):
        calls.append(tmp.read_bytes() == data)
        if len(calls) == 1:
            raise ValueError("hash mismatch")

    store.get_file("shard.mds", other, check=flaky, check_attempts=2)
    assert calls == [True, True] and other.read_bytes() == data


def test_an_object_larger_than_declared_is_not_downloaded(target, tmp_path, monkeypatch):
    store = target.open(retry=_fast_retry())
    data = _payload(300_000, seed=3)
    store.put_bytes("shard.mds", data)
    local = tmp_path / "cache" / "shard.mds"
    local.parent.mkdir()
    with pytest.raises(ObjectTooLargeError, match=r"shard.mds holds 300000 bytes, more than the 1000 expected; not"):
        store.get_file("shard.mds", local, max_bytes=1000)
    assert os.listdir(local.parent) == []
    # Replaced by a larger object between the size check and the download: the download stops at the limit.
    real_stat = store.stat
    monkeypatch.setattr(store, "stat", lambda key: dataclasses.replace(real_stat(key), size=1000))
    with pytest.raises(ObjectTooLargeError, match=r"more than the 1000 bytes expected \(at least \d+\); download stop"):
        store.get_file("shard.mds", local, max_bytes=1000)
    assert os.listdir(local.parent) == []
    monkeypatch.undo()
    assert store.get_file("shard.mds", local, max_bytes=len(data)).read_bytes() == data  # exactly the size: fine


def test_a_missing_bucket_is_named(target):
    if target.missing_bucket_url is None:
        pytest.skip("a local folder has no bucket")
    store = target.open(url=target.missing_bucket_url, retry=_fast_retry(2))
    bucket = target.missing_bucket_url.split("://")[1].split("/")[0].split("@")[0]
    for action in (lambda: store.put_bytes("k", b"x"), lambda: store.get_bytes("k"), lambda: store.stat("k"),
                   lambda: store.list()):
        with pytest.raises(BucketNotFoundError, match=f"'{bucket}' .*does not exist") as info:
            action()
        assert info.value.__suppress_context__ and info.value.__cause__ is None  # no client traceback


def test_a_20s_outage_of_every_cloud_at_once_is_ridden_out_with_nothing_corrupt(request, tmp_path, monkeypatch,
                                                                               fault_proxy):
    """Each network backend behind its own fault proxy, all browned out for 20 s at once (one wait for all):
    a multipart upload, a download and a small put on each wait it out, and every byte is right after."""
    random.seed(99)
    rng_before = random.getstate()
    errors: list[BaseException] = []
    checks: list[Callable[[], None]] = []
    threads: list[threading.Thread] = []
    proxies = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    for kind in ("s3", "gs", "az", "oci"):
        target = _make_target(kind, request, tmp_path / kind, monkeypatch)
        proxy = fault_proxy(target.upstream)
        store = target.open(proxy.url, retry=_fast_retry(budget_s=OUTAGE_S + 30), part_size=target.part_size)
        old, big = _payload(200_000, seed=3), _payload(target.part_size + 777, seed=4)
        store.put_bytes("old.bin", old)
        (tmp_path / f"{kind}-big.bin").write_bytes(big)
        local = tmp_path / "got" / kind / "old.bin"
        threads += [
            threading.Thread(target=run, args=(lambda s=store, k=kind: s.put_file(tmp_path / f"{k}-big.bin",
                                                                                  "new/big.bin"),)),
            threading.Thread(target=run, args=(lambda s=store, dst=local: s.get_file("old.bin", dst),)),
            threading.Thread(target=run, args=(lambda s=store: s.put_bytes("new/manifest.json", b"{}"),)),
        ]

        def check(store=store, proxy=proxy, local=local, old=old, big=big) -> None:
            assert len(proxy.failed()) >= 3
            assert local.read_bytes() == old
            assert store.get_bytes("new/big.bin") == big and store.stat("new/big.bin").size == len(big)
            assert [i.key for i in store.list()] == ["new/big.bin", "new/manifest.json", "old.bin"]

        checks.append(check)
        proxies.append(proxy)

    for proxy in proxies:
        proxy.brown_out(OUTAGE_S, min_failures=6)  # each call meets it, however slow the machine
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=OUTAGE_S + 90)
    elapsed = time.monotonic() - start
    assert not errors, errors
    assert elapsed >= OUTAGE_S * 0.9  # they waited the outage out rather than succeeding through it
    for check in checks:
        check()
    assert random.getstate() == rng_before  # jitter came from the policy's own generator


def test_an_outage_longer_than_the_budget_fails_cleanly(target, tmp_path, fault_proxy):
    if target.upstream is None:
        pytest.skip("a local folder has no network to fail")
    proxy = fault_proxy(target.upstream)
    store = target.open(proxy.url, retry=_fast_retry(budget_s=0.5), part_size=target.part_size)
    store.put_bytes("old.bin", b"old")
    (tmp_path / "big.bin").write_bytes(_payload(target.part_size + 1, seed=5))
    proxy.brown_out(600)  # until clear(): longer than any budget here
    local = tmp_path / "got" / "old.bin"
    with pytest.raises(RetryBudgetExceededError, match="did not recover within the retry budget of 0.5 s"):
        store.get_file("old.bin", local)
    assert not local.exists() and os.listdir(local.parent) == []
    with pytest.raises(RetryBudgetExceededError):
        store.put_file(tmp_path / "big.bin", "new/big.bin")
    proxy.clear()
    assert not store.exists("new/big.bin")  # a failed upload publishes nothing, not a part


def test_s3_upload_size_check_catches_a_short_object(s3_server, s3_bucket, tmp_path, monkeypatch):
    """The stored size is checked after a multipart upload (a store that lost a part is caught)."""
    store = open_store(f"s3://{s3_bucket}/p", endpoint_url=s3_server.endpoint_url, part_size=5 << 20,
                       retry=_fast_retry())
    (tmp_path / "f").write_bytes(b"x" * ((5 << 20) + 10))
    real = store._stat

    def short(full_key):
        info = real(full_key)
        return type(info)(info.key, info.size - 1, info.etag, info.mtime, info.version)

    monkeypatch.setattr(store, "_stat", short)
    with pytest.raises(IntegrityError, match="holds 5242889 bytes after upload, expected 5242890"):
        store.put_file(tmp_path / "f", "f")


def test_every_backend_takes_read_timeout_s(target):
    """``read_timeout_s`` (the migration table's download call) is accepted by every scheme, and used."""
    store = target.open(retry=_fast_retry(), read_timeout_s=7.5)
    store.put_bytes("t.bin", b"timed")
    assert store.get_bytes("t.bin") == b"timed"
    if target.name != "file":
        assert getattr(store, "read_timeout_s", None) == 7.5 or getattr(store, "timeout_s", None) == 7.5


def test_conditional_put_creates_once_and_refuses_a_stale_version(target):
    if target.name == "gs":
        pytest.xfail("gcp-storage-emulator (2026.7) neither reports generations nor enforces ifGenerationMatch")
    store = target.open(retry=_fast_retry())
    assert store.get_versioned("lease.json") is None
    assert store.put_if("lease.json", b"one", None) is True
    assert store.put_if("lease.json", b"two", None) is False  # it exists now: "create" must not overwrite
    data, token = store.get_versioned("lease.json")
    assert data == b"one"
    store.put_bytes("lease.json", b"changed behind our back")
    assert store.put_if("lease.json", b"three", token) is False  # stale version
    assert store.get_bytes("lease.json") == b"changed behind our back"
    data, token = store.get_versioned("lease.json")
    assert store.put_if("lease.json", b"three", token) is True
    assert store.get_versioned("lease.json")[0] == b"three"


def test_conditional_read_modify_write_from_threads_loses_no_update(target):
    if target.name == "gs":
        pytest.xfail("gcp-storage-emulator (2026.7) neither reports generations nor enforces ifGenerationMatch")
    store = target.open(retry=_fast_retry())
    per_thread, threads = 6, 3

    def add(name: str) -> None:
        own = target.open(retry=_fast_retry())
        for i in range(per_thread):
            while True:
                found = own.get_versioned("counter.txt")
                lines = found[0].decode().split() if found else []
                if own.put_if("counter.txt", " ".join([*lines, f"{name}{i}"]).encode(), found[1] if found else None):
                    break
                time.sleep(random.random() * 0.01)

    workers = [threading.Thread(target=add, args=(f"t{n}-",)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers)
    entries = store.get_bytes("counter.txt").decode().split()
    assert sorted(entries) == sorted(f"t{n}-{i}" for n in range(threads) for i in range(per_thread))

"""The cordon list: hosts found bad, each with a reason and a time, in a JSON file local or on S3.

The file is ``{"cordoned": [{"host": ..., "reason": ..., "time": ...}, ...]}``, which smalti-core's launch
tools read (``smalti.core.launch.cordon``) to keep jobs off those hosts, and ``smalti-health preflight``
reads to refuse to join. Writes never leave a half-written file: locally a temporary file renamed over
the old one under an exclusive lock on the folder (concurrent adds from several nodes all land); on S3 a
conditional put on the object's ETag, retried when another writer got there first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from smalti.core.launch.cordon import CordonedHost, parse_cordon
from smalti.core.launch.errors import LaunchError
from smalti.health.errors import HealthError


def _split_s3(path: str) -> tuple[str, str]:
    bucket, _, key = path.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise HealthError(f"cordon file {path}: an S3 path needs a bucket and a key (s3://bucket/cordon.json)")
    return bucket, key


def _s3_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None)


def _parse(text: str, source: str) -> list[dict[str, Any]]:
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise HealthError(f"cordon file {source} is not valid JSON or YAML: {exc}") from exc
    try:
        hosts = parse_cordon(data, source)
    except LaunchError as exc:
        raise HealthError(str(exc)) from exc
    extra = {e.get("host"): e for e in (data.get("cordoned", []) if isinstance(data, dict) else []) if isinstance(e, dict)}
    return [{**extra.get(h.host, {}), "host": h.host, "reason": h.reason} for h in hosts]


def _render(entries: list[dict[str, Any]]) -> str:
    return json.dumps({"cordoned": entries}, indent=2, sort_keys=True) + "\n"


def read_cordon(path: str) -> list[CordonedHost]:
    """The cordoned hosts in ``path`` (local or ``s3://``); a missing file is an empty list."""
    return [CordonedHost(e["host"], e.get("reason", "")) for e in _read_entries(path)[0]]


def is_cordoned(path: str, host: str) -> str | None:
    """The reason ``host`` is cordoned in ``path``, or None when it is not."""
    return next((h.reason or "no reason given" for h in read_cordon(path) if h.host == host), None)


def _read_entries(path: str) -> tuple[list[dict[str, Any]], str | None]:
    """Entries and, on S3, the ETag they were read at (None when the object does not exist)."""
    if path.startswith("s3://"):
        bucket, key = _split_s3(path)
        client = _s3_client()
        try:
            obj = client.get_object(Bucket=bucket, Key=key)
        except client.exceptions.NoSuchKey:
            return [], None
        return _parse(obj["Body"].read().decode(), path), obj["ETag"]
    try:
        return _parse(Path(path).read_text(), path), None
    except FileNotFoundError:
        return [], None


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _update(path: str, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]], retries: int = 8) -> None:
    if path.startswith("s3://"):
        bucket, key = _split_s3(path)
        client = _s3_client()
        for attempt in range(retries):
            entries, etag = _read_entries(path)
            body = _render(change(entries)).encode()
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                client.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json", **condition)
                return
            except client.exceptions.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code not in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                    raise HealthError(f"cordon file {path}: S3 write failed: {exc}") from exc
                time.sleep(0.05 * (attempt + 1))
        raise HealthError(f"cordon file {path}: {retries} writers raced and this one never got in; try again")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(target.parent):
        entries, _ = _read_entries(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_render(change(entries)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def add_to_cordon(path: str, host: str, reason: str) -> None:
    """Cordon ``host`` in ``path`` (created if missing); a host already there gets the new reason and time."""
    if not host.strip():
        raise HealthError(f"cordon file {path}: cannot cordon an empty host name")
    entry = {"host": host, "reason": reason, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _update(path, lambda entries: [e for e in entries if e["host"] != host] + [entry])


def remove_from_cordon(path: str, host: str) -> bool:
    """Take ``host`` off the list in ``path``; True when it was there."""
    found = [False]

    def change(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kept = [e for e in entries if e["host"] != host]
        found[0] = len(kept) != len(entries)
        return kept

    _update(path, change)
    return found[0]

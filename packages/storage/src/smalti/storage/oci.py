"""``oci://bucket@namespace/prefix``: OCI Object Storage through its S3-compatible API (boto3).

The endpoint is ``https://<namespace>.compat.objectstorage.<region>.oraclecloud.com``; the region comes from
``OCI_REGION``, else the ``region`` of the profile ``OCI_CLI_PROFILE`` (default ``DEFAULT``) in
``OCI_CONFIG_FILE`` (default ``~/.oci/config``). ``SMALTI_OCI_S3_ENDPOINT_URL`` replaces the endpoint
(tests point it at a loopback S3 server). The S3-compatible API authenticates with a *Customer Secret Key*:
``OCI_S3_ACCESS_KEY_ID`` and ``OCI_S3_SECRET_ACCESS_KEY``, else boto3's chain (for example a profile named by
``OCI_S3_PROFILE`` in ~/.aws/credentials).
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path

from smalti.storage.errors import StorageError
from smalti.storage.s3 import S3Store

ENDPOINT_ENV = "SMALTI_OCI_S3_ENDPOINT_URL"
OCI_CHAIN = (
    "OCI_S3_ACCESS_KEY_ID and OCI_S3_SECRET_ACCESS_KEY (an OCI Customer Secret Key), then boto3's chain: "
    "the profile OCI_S3_PROFILE (or AWS_PROFILE) in ~/.aws/credentials, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
)


def parse_oci_url(url: str) -> tuple[str, str, str]:
    """``oci://bucket@namespace/prefix`` -> ``(bucket, namespace, prefix)``."""
    rest = url[len("oci://") :]
    authority, _, prefix = rest.partition("/")
    bucket, at, namespace = authority.partition("@")
    if not bucket or not at or not namespace:
        raise StorageError(
            f"{url!r} is not an OCI Object Storage URL; write oci://bucket@namespace/prefix "
            "(the namespace is shown by `oci os ns get` or on the bucket's page in the console)", url
        )
    return bucket, namespace, prefix


def oci_region() -> str | None:
    """``OCI_REGION``, else the region of the active profile in the OCI config file, else ``None``."""
    if os.environ.get("OCI_REGION"):
        return os.environ["OCI_REGION"]
    path = Path(os.environ.get("OCI_CONFIG_FILE") or Path.home() / ".oci" / "config").expanduser()
    if not path.is_file():
        return None
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error:
        return None
    profile = os.environ.get("OCI_CLI_PROFILE", "DEFAULT")
    section = parser[profile] if parser.has_section(profile) else parser.defaults()
    return section.get("region") or None


class OciStore(S3Store):
    """Objects under ``oci://bucket@namespace/prefix`` (same commit semantics as S3: atomic per object)."""

    scheme = "oci"
    credentials_chain = OCI_CHAIN

    def __init__(self, url: str, endpoint_url: str | None = None, region: str | None = None, **options: object) -> None:
        bucket, namespace, prefix = parse_oci_url(url)
        self.namespace = namespace
        region = region or oci_region()
        endpoint = endpoint_url or os.environ.get(ENDPOINT_ENV)
        if not endpoint:
            if not region:
                raise StorageError(
                    f"{url}: no OCI region found; set OCI_REGION (e.g. us-ashburn-1) or `region=` in the "
                    f"[{os.environ.get('OCI_CLI_PROFILE', 'DEFAULT')}] profile of "
                    f"{os.environ.get('OCI_CONFIG_FILE', '~/.oci/config')}", url
                )
            endpoint = f"https://{namespace}.compat.objectstorage.{region}.oraclecloud.com"
        options.setdefault("access_key_id", os.environ.get("OCI_S3_ACCESS_KEY_ID"))
        options.setdefault("secret_access_key", os.environ.get("OCI_S3_SECRET_ACCESS_KEY"))
        options.setdefault("profile", os.environ.get("OCI_S3_PROFILE"))
        super().__init__(
            f"oci://{bucket}@{namespace}/{prefix.strip('/')}".rstrip("/"), bucket, prefix,
            endpoint_url=endpoint, region=region or "us-ashburn-1", addressing_style="path", **options,  # type: ignore[arg-type]
        )

"""URL parsing, scheme selection, third-party schemes through entry points, and the errors a user reads."""

import subprocess
import sys
import textwrap

import pytest

from smalti.storage import (
    CredentialsError,
    MissingClientError,
    ObjectStore,
    StorageError,
    UnknownSchemeError,
    available_schemes,
    open_object,
    open_store,
    split_url,
)
from smalti.storage.local import LocalStore
from smalti.storage.oci import OciStore


def test_split_url():
    assert split_url("s3://b/k/x.mds") == ("s3", "b", "k/x.mds")
    assert split_url("gs://b") == ("gs", "b", "")
    assert split_url("oci://b@ns/p/") == ("oci", "b@ns", "p")
    assert split_url("file:///tmp/x") == ("file", "", "/tmp/x")
    assert split_url("/tmp/x") == ("file", "", "/tmp/x")


def test_plain_paths_and_file_urls_open_local_stores(tmp_path):
    for url in (tmp_path, str(tmp_path), tmp_path.as_uri()):
        store = open_store(url)
        assert isinstance(store, LocalStore) and store.root == tmp_path
    store, key = open_object(tmp_path / "a" / "b.bin")
    assert key == "b.bin" and store.url_of(key) == str(tmp_path / "a" / "b.bin")


def test_unknown_scheme_names_what_is_available_and_how_to_add_one():
    with pytest.raises(UnknownSchemeError) as info:
        open_store("hf://org/repo/data")
    msg = str(info.value)
    assert "hf://" in msg and "(have: az, azure, file, gs, oci, s3)" in msg
    assert "smalti.storage" in msg and "entry-points" in msg


@pytest.mark.parametrize(
    "url, module, extra",
    [
        ("s3://b/p", "boto3", "s3"),
        ("oci://b@ns/p", "boto3", "s3"),
        ("gs://b/p", "google.cloud.storage", "gcs"),
        ("az://c/p", "azure.storage.blob", "azure"),
    ],
)
def test_a_missing_client_library_names_the_pip_extra(url, module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    monkeypatch.setenv("OCI_REGION", "us-ashburn-1")
    with pytest.raises(MissingClientError, match=rf'pip install "smalti-storage\[{extra}\]"'):
        open_store(url)


def test_third_party_scheme_through_an_entry_point(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "memstore_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "memstore_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: memstore-plugin\nVersion: 0.1\n"
    )
    (site / "memstore_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[smalti.storage]\nmem = memstore_plugin:open_mem\n"
    )
    (site / "memstore_plugin.py").write_text(textwrap.dedent("""
        import os
        from smalti.storage.local import LocalStore

        class MemStore(LocalStore):
            scheme = "mem"

        def open_mem(url, **options):
            return MemStore(os.path.join(os.environ["MEMSTORE_ROOT"], url.split("://", 1)[1]), **options)
    """))
    monkeypatch.setenv("MEMSTORE_ROOT", str(tmp_path / "mem"))
    with pytest.raises(UnknownSchemeError):
        open_store("mem://bucket/x")
    monkeypatch.syspath_prepend(site)
    assert "mem" in available_schemes()
    store = open_store("mem://bucket/x")
    assert isinstance(store, ObjectStore) and store.scheme == "mem"
    store.put_bytes("k", b"payload")
    assert (tmp_path / "mem" / "bucket" / "x" / "k").read_bytes() == b"payload"


def test_a_plugin_that_fails_to_import_is_named(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "broken_store-0.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-store\nVersion: 0.2\n")
    (info / "entry_points.txt").write_text("[smalti.storage]\nbroken = broken_store_mod:Store\n")
    monkeypatch.syspath_prepend(site)
    with pytest.raises(StorageError, match="broken:// backend .*broken-store.* failed to import"):
        open_store("broken://b/p")


def test_oci_endpoint_from_namespace_and_region(tmp_path, monkeypatch):
    monkeypatch.delenv("SMALTI_OCI_S3_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("OCI_REGION", "eu-frankfurt-1")
    store = open_store("oci://models@axyz123/runs/a")
    assert isinstance(store, OciStore)
    assert store.endpoint_url == "https://axyz123.compat.objectstorage.eu-frankfurt-1.oraclecloud.com"
    assert (store.bucket, store.prefix, store.url) == ("models", "runs/a", "oci://models@axyz123/runs/a")
    # the region from the OCI config file's active profile
    monkeypatch.delenv("OCI_REGION")
    config = tmp_path / "oci-config"
    config.write_text("[DEFAULT]\nregion=us-ashburn-1\n[TRAIN]\nregion=ap-tokyo-1\n")
    monkeypatch.setenv("OCI_CONFIG_FILE", str(config))
    monkeypatch.setenv("OCI_CLI_PROFILE", "TRAIN")
    assert open_store("oci://m@ns/p").endpoint_url == "https://ns.compat.objectstorage.ap-tokyo-1.oraclecloud.com"


def test_oci_url_and_region_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("SMALTI_OCI_S3_ENDPOINT_URL", raising=False)
    with pytest.raises(StorageError, match="oci://bucket@namespace/prefix"):
        open_store("oci://models/runs")
    monkeypatch.delenv("OCI_REGION", raising=False)
    monkeypatch.setenv("OCI_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StorageError, match="no OCI region found; set OCI_REGION"):
        open_store("oci://m@ns/p")


def test_azure_without_any_account_or_credential_says_where_it_looked(monkeypatch):
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME",
                "AZURE_STORAGE_ACCOUNT_URL", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(CredentialsError, match="AZURE_STORAGE_CONNECTION_STRING.*AZURE_STORAGE_ACCOUNT"):
        open_store("az://container/p")
    monkeypatch.setitem(sys.modules, "azure.identity", None)
    with pytest.raises(CredentialsError, match="account https://acct.blob.core.windows.net.*DefaultAzureCredential"):
        open_store("az://container@acct/p")


def _run_isolated(code: str, env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def _clean_env(tmp_path) -> dict[str, str]:
    import os

    keep = ("PATH", "LANG", "SYSTEMROOT", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(HOME=str(tmp_path), NO_GCE_CHECK="true", GCE_METADATA_HOST="127.0.0.1:9",
               GCE_METADATA_IP="127.0.0.1:9", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    return env


@pytest.mark.parametrize("url, names", [
    ("s3://bucket/p", ["AWS_ACCESS_KEY_ID", "~/.aws/credentials", "instance metadata"]),
    ("oci://bucket@ns/p", ["OCI_S3_ACCESS_KEY_ID", "Customer Secret Key", "OCI_S3_PROFILE"]),
])
def test_missing_s3_credentials_name_the_chain_without_a_traceback_of_boto(url, names, tmp_path, s3_server):
    env = {**_clean_env(tmp_path), "OCI_REGION": "us-ashburn-1"}
    proc = _run_isolated(f"""
        from smalti.storage import open_store
        open_store("{url}", endpoint_url="{s3_server.endpoint_url}").put_bytes("k", b"x")
    """, env, tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"smalti.storage.errors.CredentialsError: no usable credentials for {url}/k")
    assert all(name in last for name in names), last
    assert proc.stderr.count("Traceback") == 1 and "botocore" not in proc.stderr


def test_missing_gcs_credentials_name_the_chain(tmp_path):
    env = _clean_env(tmp_path)
    proc = _run_isolated("""
        from smalti.storage import open_store
        open_store("gs://bucket/p").get_bytes("k")
    """, env, tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("smalti.storage.errors.CredentialsError: no Google Cloud credentials for gs://bucket/p/k")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in last and "metadata server" in last
    assert proc.stderr.count("Traceback") == 1

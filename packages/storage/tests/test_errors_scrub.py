"""smalti-storage's errors name the URL at fault without the credentials a URL can carry."""

from smalti.storage import open_object
from smalti.storage.errors import StorageError, UnknownSchemeError


def test_errors_never_print_url_credentials():
    err = StorageError("cannot read https://acct:p@ss9@blob.example/c/x?sv=2020&sig=SIG7&se=1",
                       url="s3://b/k?X-Amz-Signature=AMZ3&X-Amz-Credential=AKIA5&token=TOK2")
    text = f"{err} {err.url}"
    for secret in ("p@ss9", "ss9", "SIG7", "AMZ3", "AKIA5", "TOK2"):
        assert secret not in text, text
    assert "https://***@blob.example/c/x?sv=2020&sig=***&se=1" in str(err)
    try:
        open_object("zz://user:hunter2x@host/x")
    except UnknownSchemeError as exc:
        assert "hunter2x" not in str(exc) and "zz://***@host" in str(exc)
    else:
        raise AssertionError("zz:// has no backend")


def test_an_oci_bucket_at_namespace_is_not_taken_for_credentials():
    assert "oci://bucket@namespace/prefix" in str(StorageError("write oci://bucket@namespace/prefix"))

"""The plugin's own fixtures and marker, used the way the other packages use them."""

import socket

import pytest

from smalti.testing import free_port


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.world_size(2)
def test_world_size_marker_runs_ranks_with_a_process_group(shared_tmp_path):
    import torch
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 2
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    assert total.item() == 3.0
    (shared_tmp_path / f"rank{dist.get_rank()}").write_text("here")
    dist.barrier()
    assert sorted(p.name for p in shared_tmp_path.iterdir()) == ["rank0", "rank1"]


def test_s3_server_round_trip(s3_server, s3_bucket):
    import os

    import boto3

    assert os.environ["S3_ENDPOINT_URL"] == s3_server.endpoint_url
    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    client.put_object(Bucket=s3_bucket, Key="a/b.txt", Body=b"payload")
    assert client.get_object(Bucket=s3_bucket, Key="a/b.txt")["Body"].read() == b"payload"


def test_s3_bucket_is_fresh_per_test(s3_server, s3_bucket):
    listing = s3_server.client().list_objects_v2(Bucket=s3_bucket)
    assert listing.get("KeyCount", 0) == 0


@pytest.mark.world_size(2)
def test_ranks_share_the_parent_s3_server(s3_server, s3_bucket):
    import torch.distributed as dist

    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key=f"r{dist.get_rank()}", Body=b"x")
    dist.barrier()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == ["r0", "r1"]

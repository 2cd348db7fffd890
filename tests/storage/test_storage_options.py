"""Storage options: fsspec's keyword arguments passed on untouched, shardckpt's tuning typed (``StorageTuning``), the
command line's ``-o`` pairs split at the edge, and the old dict keys deprecated for one release."""
from __future__ import annotations

import socket
import warnings

import pytest

from shardckpt import StorageConfigError, StorageOptions, StorageTuning, open_storage
from shardckpt.options import storage_options_from
from shardckpt.storage_options import as_storage_options


def _closed_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _s3(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"region_name": "us-east-1"}}


@pytest.mark.parametrize("field, value", [("retry_deadline_s", -1), ("connect_deadline_s", float("inf")),
                                          ("part_size", 1.5), ("concurrency", True), ("retry_deadline_s", "9")])
def test_a_tuning_field_of_the_wrong_kind_is_refused_by_name(field, value):
    with pytest.raises(StorageConfigError, match=field):
        StorageTuning(**{field: value})


def test_the_command_lines_pairs_are_split_at_the_edge_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = storage_options_from(["endpoint_url=http://h:9000", "retry_deadline_s=5", "connect_deadline_s=1",
                                        "client_kwargs.region_name=eu", "max_concurrency=4"])
    assert options == StorageOptions({"endpoint_url": "http://h:9000", "client_kwargs": {"region_name": "eu"},
                                      "max_concurrency": 4}, StorageTuning(retry_deadline_s=5, connect_deadline_s=1))
    assert storage_options_from([]) is None
    with pytest.raises(ValueError, match="retry_deadline_s"):
        storage_options_from(['retry_deadline_s={"a": 1}'])


def test_a_plain_dict_is_fsspecs_and_shardckpts_keys_in_it_are_deprecated():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_storage_options({"anon": True}) == StorageOptions({"anon": True})
        assert as_storage_options(None) == StorageOptions()
    given = {"anon": True, "retry_deadline_s": 30}
    with pytest.warns(DeprecationWarning, match=r"StorageTuning\(retry_deadline_s=30\)"):
        options = as_storage_options(given)
    assert options == StorageOptions({"anon": True}, StorageTuning(retry_deadline_s=30))
    assert given == {"anon": True, "retry_deadline_s": 30}  # the caller's dict is left as it was
    with pytest.raises(StorageConfigError, match="StorageOptions"):
        as_storage_options(["anon"])


def test_s3_takes_the_typed_tuning_and_passes_fsspecs_options_on_untouched():
    options = StorageOptions(_s3(_closed_endpoint()), StorageTuning(retry_deadline_s=7, concurrency=3))
    storage = open_storage("s3://bucket/x", options)  # no request made: s3fs builds its client only
    assert (storage.tuning.retry_deadline_s, storage.tuning.concurrency, storage.stream_lanes) == (7, 3, 3)
    assert "config_kwargs" not in options.fsspec  # botocore's defaults went into a copy


def test_s3_still_takes_the_old_keys_for_one_release_with_a_warning():
    with pytest.warns(DeprecationWarning, match="StorageTuning"):
        storage = open_storage("s3://bucket/x", {**_s3(_closed_endpoint()), "retry_deadline_s": 9,
                                                 "connect_deadline_s": 0.5})
    assert (storage.tuning.retry_deadline_s, storage.tuning.connect_deadline_s) == (9, 0.5)
    # s3fs's own keys steer shardckpt's S3 path where the tuning leaves them unset, as before
    storage = open_storage("s3://bucket/x", {**_s3(_closed_endpoint()), "max_concurrency": 5,
                                             "default_block_size": 16 << 20})
    assert (storage.tuning.concurrency, storage.tuning.part_size) == (5, 16 << 20)


def test_a_storage_is_opened_as_itself(tmp_path):
    storage = open_storage(tmp_path)
    assert open_storage(storage) is storage and open_storage(storage, {"anon": True}) is storage

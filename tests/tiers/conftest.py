"""The S3 server on 127.0.0.1 of the storage suite, for tier 2 on an object store."""
from tests.storage.conftest import s3_bucket, s3_server  # noqa: F401 - fixtures, registered by name

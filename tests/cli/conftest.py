"""The S3 server on 127.0.0.1 of the storage suite, for the CLI's tests of s3:// URLs."""
from tests.storage.conftest import s3_server  # noqa: F401 - a fixture, registered by name

"""TierConfig: frozen, every field checked on construction, the message naming the field."""
from __future__ import annotations

import dataclasses

import pytest

from shardckpt.tiers.config import TierConfig, TierConfigError


def test_defaults_and_schedules():
    c = TierConfig(local_dir="/dev/shm/shardckpt", run_id="job-1", persistent_dir="s3://b/run",
                   local_every=10, persistent_every=100, local_budget="24GiB")
    assert c.local_budget == 24 << 30 and c.min_free == 1 << 30 and c.replicas == 1 and c.keep_last == 2
    assert c.saves_locally(20) and not c.saves_locally(25) and c.persists(200) and not c.persists(110)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.replicas = 2  # type: ignore[misc]
    assert c.replace(replicas=2).replicas == 2


@pytest.mark.parametrize("changes, field", [
    ({"run_id": "a/b"}, "run_id"),
    ({"run_id": ""}, "run_id"),
    ({"local_dir": ""}, "local_dir"),
    ({"local_every": 0}, "local_every"),
    ({"local_every": True}, "local_every"),
    ({"persistent_every": 15, "local_every": 10, "persistent_dir": "/p"}, "multiple of local_every"),
    ({"persistent_every": 10}, "persistent_dir is None"),
    ({"replicas": -1}, "replicas"),
    ({"keep_last": 0}, "keep_last"),
    ({"local_budget": "lots"}, "local_budget"),
    ({"min_free": 0}, "min_free"),
    ({"on_full": "ignore"}, "on_full"),
    ({"verify": "never"}, "verify"),
    ({"node_id": ""}, "node_id"),
    ({"peer_port": 70000}, "peer_port"),
    ({"peer_timeout_s": 0}, "peer_timeout_s"),
    ({"peer_timeout_s": float("inf")}, "peer_timeout_s"),  # helper-21: an OverflowError at the first peer read
    ({"node_id": "<persistent>"}, "reserved"),  # tier 2's name where a node's is expected
    ({"peer_host": ""}, "peer_host"),
    ({"keep_local_on_close": "no"}, "keep_local_on_close"),
])
def test_a_bad_field_is_named(changes, field):
    with pytest.raises(TierConfigError, match=field):
        TierConfig(**{"local_dir": "/dev/shm/x", "run_id": "r", **changes})
    assert issubclass(TierConfigError, ValueError)

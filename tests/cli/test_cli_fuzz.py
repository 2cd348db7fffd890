"""The ``shardckpt`` command never prints a traceback: argument lists and ``--storage-option`` values from a
seeded fuzzer, over sources of every format on local disk, ``memory://`` and S3 (moto on 127.0.0.1), end in
exit 0, 1 or 2 with, on error, one line naming the command. An internal error (exit 3, the last resort for a
bug) counts as a failure here, as does anything escaping ``main``.

``SHARDCKPT_CLI_FUZZ_CASES`` sets the number of cases (default 400, about 10 s here); the seed is fixed, so a
failure reproduces. Spreading a convert over worker processes is left out (each starts Python with torch:
``tests/convert/test_convert_spread.py`` covers it); ``--workers`` still gets invalid values.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import uuid

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shardckpt
from shardckpt import StateDictType
from shardckpt.cli.main import main
from shardckpt.offline.export import export
from shardckpt.runtime import shard

CASES = int(os.environ.get("SHARDCKPT_CLI_FUZZ_CASES", "400"))
VALUES = ["", "0", "-1", "1", "2", "3", "nan", "inf", "-inf", "1e400", "99999999999999999999999", "abc", "5GB",
          "0.5", "1KiB", "bfloat16", "float64", "int8", "zstd", "zstd:99", "zstd:-100", "zstd:3", "name", "id", "full",
          "sharded", "local", "{", "[]", "model", "model.w", "optim", "\u00e9", " ", "1MiB", "-5", "1.5GB", "0B", "keep",
          "null", "--json"]
OPTION_KEYS = ["endpoint_url", "key", "secret", "anon", "client_kwargs", "client_kwargs.region_name", "config_kwargs",
               "config_kwargs.retries", "default_block_size", "max_concurrency", "retry_deadline_s", "connect_deadline_s", "use_ssl",
               "version_aware", "x", "a.b.c", "requester_pays", "cache_regions", "skip_instance_cache",
               "s3_additional_kwargs", "auto_mkdir"]
OPTION_VALUES = ['{bad json', '5', '-1', 'true', 'null', '"x"', '[1,2]', '{"a": 1}', '{}', 'http://127.0.0.1:1', '0',
                 '1e9', 'abc', '{"max_pool_connections": -3}', '{"region_name": 5}', '0.0', '{"retries": "x"}',
                 '{"connect_timeout": "x"}', '1e400', 'nan', '[', '{"max_attempts": "many"}']
# Each option with values that make sense for it (picked 3 times in 4) besides the junk in VALUES.
VERBS: dict[str, list[tuple[str, ...]]] = {
    "inspect": [("--json",), ("--stored",)],
    "verify": [("--quiet",), ("--json",), ("--against", "P"), ("--only", "model", "model.w", "optim"),
               ("--strip-prefix", "model.", "w"), ("--threads", "1", "4", "256")],
    "convert": [("--world-size", "1", "2", "3", "7"), ("--type", "full", "sharded", "local"),
                ("--optim-key", "name", "id"), ("--dtype", "bfloat16", "float16", "float32", "int8"),
                ("--only", "model", "model.w", "optim", "step"), ("--exclude", "model.w", "optim", "step"),
                ("--compress", "zstd", "zstd:3", "zstd:-7"), ("--memory-limit", "64MiB", "1GiB", "1KiB"),
                ("--workers", "1", "0", "-2", "x"), ("--overwrite",), ("--quiet",)],
    "export": [("--dtype", "bfloat16", "keep", "float32", "int8"), ("--max-shard-size", "100", "1KB", "5GB"),
               ("--only", "model", "model.w", "optim"), ("--strip-prefix", "model.", "w"),
               ("--memory-limit", "64MiB", "1KiB"), ("--overwrite",), ("--quiet",), ("--rename-map", "P")],
    "diff": [("--atol", "0", "1e-3", "5"), ("--rtol", "0", "1e-6"), ("--json",)],
    "gc": [("--dry-run",), ("--min-age", "0", "600")],
    "latest": [],
}
for _options in VERBS.values():  # every verb takes these
    _options += [o for o in [("-q",), ("--quiet",), ("-v",), ("--json",)] if o not in _options]
POSITIONALS = {"inspect": 1, "verify": 1, "convert": 2, "export": 2, "diff": 2, "gc": 1, "latest": 1}
# (rm is not fuzzed: it would remove the sources the other cases read)


def _local_checkpoint(path: str) -> None:
    model = shard(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), wrap=(nn.Linear,))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    shardckpt.save_state(model, optim, path, type=StateDictType.LOCAL_STATE_DICT, extra={"step": 1})


@pytest.fixture(scope="module")
def places(tmp_path_factory, s3_server):
    """(a scratch directory, sources, output places, the S3 endpoint): every format, on every backend, plus things that are none."""
    root = str(tmp_path_factory.mktemp("fuzz"))
    bucket = f"fuzz-{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(bucket)
    mem = f"memory://fuzz-{uuid.uuid4().hex[:8]}"
    state = {"model": {"w": torch.randn(8, 4), "i": torch.arange(5)}, "optim": {"state": {}, "param_groups": []},
             "step": 3}
    shardckpt.save(state, f"{root}/ck")
    shardckpt.save(state, f"{root}/zstd", compress="zstd")
    shardckpt.save(state, f"{bucket}/ck".join(("s3://", "")), storage_options=s3_server.options())
    shardckpt.save(state, f"{mem}/ck")
    _local_checkpoint(f"{root}/local")
    save_file({"w": torch.randn(3, 3)}, f"{root}/m.safetensors")
    export(f"{root}/ck", f"{root}/hf", max_shard_size=100)
    torch.save({"w": torch.randn(2)}, f"{root}/t.pt")
    with open(f"{root}/junk", "wb") as f:
        f.write(b"\x00" * 100)
    with open(f"{root}/rename.json", "w") as f:
        f.write('{"w": "weight"}')
    os.makedirs(f"{root}/empty")
    fixtures = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")
    shutil.copytree(os.path.join(fixtures, "deepspeed", "zero3", "checkpoint"), f"{root}/zero3")
    shutil.copytree(os.path.join(fixtures, "v1"), f"{root}/v1")
    readable = [f"{root}/ck", f"{root}/zstd", f"{root}/local", f"{root}/m.safetensors", f"{root}/hf", f"{root}/t.pt",
                f"s3://{bucket}/ck", f"{mem}/ck", f"{root}/zero3", "v1"]  # a relative path too
    others = [f"{root}/junk", f"{root}/empty", f"{root}/nothing", f"{root}/rename.json", f"{root}/ck/manifest.json",
              f"s3://{bucket}/nothing", "s3://no-such-bucket/x", "s3://", f"s3://{bucket}", f"{mem}/nothing",
              "foo://bar", "", "/dev/null", "http://127.0.0.1:1/x", "-", "\u00e9"]
    outputs = [f"{root}/out{{}}", f"{mem}/out{{}}", f"s3://{bucket}/out{{}}"]
    return root, readable * 3 + others, outputs, s3_server.endpoint


def _argv(rng: random.Random, sources: list[str], outputs: list[str], endpoint: str) -> list[str]:
    verb = rng.choice(list(VERBS))
    argv = [verb]
    for i in range(POSITIONALS[verb]):
        if verb in ("convert", "export") and i == 1 and rng.random() < 0.7:
            argv.append(rng.choice(outputs).format(rng.randrange(4)))
        else:
            argv.append(rng.choice(sources))
    for _ in range(rng.randrange(4)):
        option = rng.choice(VERBS[verb] + [("--bogus",)] * (rng.random() < 0.05))
        argv.append(option[0])
        if option[1:] == ("P",):
            argv.append(rng.choice(sources))
        elif option[1:]:
            argv.append(rng.choice(option[1:]) if rng.random() < 0.75 else rng.choice(VALUES))
    on_s3 = any(a.startswith("s3://") for a in argv)
    if on_s3:  # never let a request leave 127.0.0.1: every s3 URL gets the local endpoint
        argv += ["-o", f"endpoint_url={endpoint}"]
    for _ in range(rng.choice((0, 0, 1, 2))):
        key = rng.choice(OPTION_KEYS[1:] if on_s3 else OPTION_KEYS)
        argv += [rng.choice(["-o", "--storage-option"]),
                 f"{key}={rng.choice(OPTION_VALUES)}" if rng.random() < 0.95 else key]
    return argv


def _run(argv: list[str]) -> tuple[object, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    except BaseException as e:  # noqa: BLE001 - what the test is looking for
        code = f"raised {type(e).__name__}: {e}"
    return code, err.getvalue()


def _problem(code: object, err: str) -> str | None:
    if not isinstance(code, int) or code not in (0, 1, 2):
        return f"exit {code}: {err.strip()[-300:]}"
    if "Traceback" in err or "internal error" in err:
        return err.strip()[-300:]
    errors = [line for line in err.splitlines() if ": error:" in line]
    if code == 2 and len(errors) != 1 and "usage:" not in err:
        return f"expected one error line naming the command, got {err.strip()[-300:]!r}"
    return None


def test_no_argument_list_gets_a_traceback(places, monkeypatch):
    root, sources, outputs, endpoint = places
    monkeypatch.chdir(root)  # a source used as a destination ("", "-", "v1") writes there, never in the repository
    rng = random.Random(34)
    failures, codes = [], {}
    for _ in range(CASES):
        argv = _argv(rng, sources, outputs, endpoint)
        code, err = _run(argv)
        codes[code] = codes.get(code, 0) + 1
        problem = _problem(code, err)
        if problem:
            failures.append(f"shardckpt {' '.join(map(repr, argv))}\n    -> {problem}")
    print(f"{CASES} argument lists: exit codes {dict(sorted(codes.items(), key=str))}")
    assert not failures, f"{len(failures)} of {CASES} argument lists failed:\n" + "\n".join(failures[:20])
    assert codes.get(0, 0) >= CASES // 20 and codes.get(2, 0) >= CASES // 5  # both sides are exercised


@pytest.mark.parametrize("argv, says", [
    (["inspect", "foo://bar"], "Protocol not known"),
    (["inspect", "s3://"], "no bucket"),
    (["inspect", "s3://b/x", "-o", "client_kwargs={bad json"], "not valid JSON"),
    (["inspect", "s3://b/x", "-o", "client_kwargs=abc"], "client_kwargs: expected a JSON object"),
    (["inspect", "s3://b/x", "-o", "max_concurrency=1e400"], "max_concurrency: expected a positive integer"),
    (["inspect", "s3://b/x", "-o", "retry_deadline_s={\"a\": 1}"], "retry_deadline_s"),
    (["inspect", "s3://b/x", "-o", "a.b=1"], "unexpected keyword argument 'a'"),
    (["inspect", "s3://b/x", "-o", "key=k"], "Partial credentials"),
    (["diff", "a", "b", "--atol", "-1"], "expected a finite number >= 0"),
    (["verify", "a", "--threads", "0"], "expected an integer from 1 to 256"),
])
def test_refused_options_are_one_line_naming_what(argv, says, s3_server, capsys):
    argv = argv + (["-o", f"endpoint_url={s3_server.endpoint}"] if any(a.startswith("s3://") for a in argv) else [])
    code, err = _run(argv)
    assert code == 2 and says in err and "Traceback" not in err, err


def test_an_internal_error_is_one_line_unless_the_traceback_is_asked_for(tmp_path, monkeypatch, capsys):
    from shardckpt.checkpoint import describe

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(describe, "describe", lambda *a, **k: broken(None))
    assert main(["inspect", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: RuntimeError: a bug" in err and "SHARDCKPT_TRACEBACK=1" in err
    monkeypatch.setenv("SHARDCKPT_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["inspect", str(tmp_path)])

"""Job-side helpers of the compile cache and the signing-key configuration."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dflash.cache.fingerprint import canonical_json as job_canonical
from dflash.cache.job_side import compiled_event, expect_warm, use_cache_dir
from runner.cache.signing import hmac_key_id, load_keyring
from runner.canonical import canonical_json as runner_canonical
from runner.errors import RunnerError


def test_use_cache_dir_points_both_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "DFLASH_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    root = use_cache_dir(tmp_path / "c")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton")
    assert stat.S_IMODE((root / "inductor").stat().st_mode) == 0o700
    os.chmod(root / "triton", 0o777)
    with pytest.raises(PermissionError, match="chmod 700"):
        use_cache_dir(root)


def test_events(monkeypatch: pytest.MonkeyPatch) -> None:
    delta = {"fxgraph_hits": 2, "fxgraph_misses": 3, "autograd_hits": 1, "autograd_misses": 0}
    ev = compiled_event(1.23456, delta, shape=[8, 256])
    assert (ev["hits"], ev["misses"], ev["seconds"], ev["shape"]) == (3, 3, 1.235, [8, 256])
    monkeypatch.delenv("DFLASH_EXPECT_WARM_CACHE", raising=False)
    assert expect_warm(delta) is None, "no warm cache expected: no cache_miss"
    monkeypatch.setenv("DFLASH_EXPECT_WARM_CACHE", "1")
    miss = expect_warm(delta)
    assert miss is not None and miss["fxgraph_misses"] == 3 and "dflashctl cache restore" in miss["detail"]
    assert expect_warm({**delta, "fxgraph_misses": 0}) is None


def test_canonical_json_agrees_across_halves() -> None:
    value = {"b": [1, 2.5, None, "ü"], "a": {"z": True, "y": "x"}}
    assert job_canonical(value) == runner_canonical(value)


def test_signing_key_from_config_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_CACHE_SIGNING_KEY", raising=False)
    cfg = tmp_path / "config.toml"
    cfg.write_text('[cache]\nsigning_key = "config secret, long enough"\n')
    assert load_keyring(cfg).hmac_secret == b"config secret, long enough"
    monkeypatch.setenv("DFLASH_CACHE_SIGNING_KEY", "env secret, long enough!")
    ring = load_keyring(cfg)
    assert ring.hmac_secret == b"env secret, long enough!"
    assert hmac_key_id(ring.hmac_secret).startswith("hmac:")
    monkeypatch.setenv("DFLASH_CACHE_SIGNING_KEY", "short")
    with pytest.raises(RunnerError, match="at least 16 bytes"):
        load_keyring(cfg)

"""The Ray Serve application's builder and config file, without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.deployment import Application
from ray.serve.schema import ServeDeploySchema

from blockserve.cluster.app import build_app, router_config
from blockserve.cluster.config import ClusterConfig
from blockserve.engine.args import EngineArgs
from blockserve.errors import InvalidConfigError

CONFIG = Path(__file__).parents[2] / "deploy" / "ray-serve.yaml"


def test_the_example_config_is_a_serve_config_whose_args_build_the_app() -> None:
    """deploy/ray-serve.yaml validates as a Serve deploy config; its args build the app."""
    schema = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = schema.applications
    assert application.import_path == "blockserve.cluster.app:build_app"
    assert isinstance(build_app(application.args), Application)


def test_router_config_passes_the_engines_hashing_to_the_kv_router() -> None:
    """The router hashes with the engines' block size, algorithm and adapters' paths; pow2 is
    Ray's default."""
    engine_args = EngineArgs(
        block_size=32, prefix_caching_hash_algo="sha256_cbor", lora_modules=("caps=/a/caps",)
    )
    kv = router_config(engine_args, ClusterConfig(replicas=2, router="kv"))
    assert kv == {
        "request_router_class": "blockserve.cluster.router:KVCacheAwareRouter",
        "request_router_kwargs": {
            "policy": "kv",
            "block_size": 32,
            "hash_algo": "sha256_cbor",
            "lora_paths": {"caps": "/a/caps"},
            "prefix_weight": 2.0,
        },
        "request_routing_stats_period_s": 1.0,
    }
    pow2 = router_config(engine_args, ClusterConfig(replicas=2, router="pow2"))
    assert pow2 == {"request_routing_stats_period_s": 1.0}


def test_unknown_args_and_unseeded_hashes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt option names itself; xxhash without PYTHONHASHSEED cannot be shared by the
    router and the replicas, so the app is refused before anything starts."""
    with pytest.raises(InvalidConfigError, match="'replica'"):
        build_app({"replica": 2})
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(InvalidConfigError, match="PYTHONHASHSEED"):
        build_app({"prefix_caching_hash_algo": "xxhash"})

"""ServiceConfig: defaults, YAML + dotted CLI overrides, frozen sections, clear errors for
unknown keys (at any depth) and bad values."""

from __future__ import annotations

import pydantic
import pytest

import settings
from deploy.config import (
    ConfigError,
    DecodeConfig,
    RouterConfig,
    ServiceConfig,
    parse_overrides,
)


def test_defaults_without_a_file():
    cfg = ServiceConfig.load(None, {})
    assert cfg.spec.num_speculative_tokens == 0
    assert cfg.router.queue_size > 0 and cfg.router.max_prompt_bytes == 1 << 20
    assert cfg.kv_transfer.backend in ("ucx", "tcp", "local")
    assert cfg.cluster.address is None


def test_yaml_then_overrides_win(tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text(
        "model: {name: tiny, max_model_len: 512}\n"
        "decode: {num_nodes: 2, max_num_seqs: 8}\n"
        "router: {port: 0, policy: round_robin}\n"
        "kv_transfer: {backend: local}\n"
    )
    cfg = ServiceConfig.load(str(path), {"decode.num_nodes": 4, "spec.num_speculative_tokens": "2"})
    assert cfg.model.name == "tiny" and cfg.model.max_model_len == 512
    assert cfg.decode.num_nodes == 4 and cfg.decode.max_num_seqs == 8
    assert cfg.spec.num_speculative_tokens == 2  # CLI strings are coerced
    assert cfg.router.policy == "round_robin" and cfg.kv_transfer.backend == "local"


def test_draft_vocab_size_reaches_the_engine_config():
    from deploy.actors import engine_config

    cfg = ServiceConfig.load(None, {"spec.num_speculative_tokens": 3, "spec.draft_vocab_size": "4096"})
    assert cfg.spec.draft_vocab_size == 4096 and ServiceConfig().spec.draft_vocab_size is None  # None: the engine's auto
    assert engine_config(cfg, "decode").draft_vocab_size == 4096
    assert engine_config(ServiceConfig(), "decode").draft_vocab_size is None


def test_empty_yaml_file_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert ServiceConfig.load(path, None) == ServiceConfig()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"decode.num_nodez": 2}, "unknown config key 'decode.num_nodez' in 'decode'; known: max_num_seqs"),
        ({"decoder.num_nodes": 2}, "unknown config key 'decoder' at the top level"),
        ({"router.port.x": 1}, "router.port"),
        ({"spec.num_speculative_tokens": -1}, "spec.num_speculative_tokens"),
        ({"spec.draft_vocab_size": -1}, "spec.draft_vocab_size"),
        ({"kv_transfer.backend": "carrier-pigeon"}, "kv_transfer.backend"),
        ({"model.dtype": "int3"}, "model.dtype"),
        ({"decode.num_nodes": 0}, "decode.num_nodes"),
        ({"router.port": 70000}, "router.port"),
        ({"cache.block_size": "big"}, "cache.block_size"),
        ({"decode": 3}, "section 'decode' must be a mapping"),
    ],
)
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        ServiceConfig.load(None, overrides)


def test_unknown_nested_key_in_yaml(tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text("router:\n  queue_size: 4\n  retries: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'router.retries'"):
        ServiceConfig.load(path, {})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ServiceConfig.load(tmp_path / "missing.yaml", {})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not sections\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        ServiceConfig.load(bad, {})
    broken = tmp_path / "broken.yaml"
    broken.write_text("router: {port: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ServiceConfig.load(broken, {})


def test_sections_are_frozen_and_forbid_extras():
    cfg = ServiceConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.router.port = 1  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        DecodeConfig(max_num_seqs=4, unknown=1)  # type: ignore[call-arg]
    assert RouterConfig(port=0).port == 0


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(["decode.num_nodes=3", "cluster.address=null", "router.host=127.0.0.1",
                            "model.name=tiny"]) == {
        "decode.num_nodes": 3, "cluster.address": None, "router.host": "127.0.0.1", "model.name": "tiny"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["decode.num_nodes"])


def test_load_format_and_max_model_len_flags_reach_the_model_config():
    import argparse

    from deploy.cli_service import add_service_arguments, service_config

    parser = argparse.ArgumentParser()
    add_service_arguments(parser)
    cfg = service_config(parser.parse_args(["--model", "llama-3.1-8b", "--load-format", "dummy",
                                            "--max-model-len", "8192"]))
    assert (cfg.model.name, cfg.model.load_format, cfg.model.max_model_len) == ("llama-3.1-8b", "dummy", 8192)
    assert service_config(parser.parse_args([])).model.load_format == "auto"
    with pytest.raises(ConfigError, match="load_format"):
        ServiceConfig.load(None, {"model.load_format": "random"})


def test_enforce_eager_and_deterministic_flags_reach_the_engine_config():
    import argparse

    from deploy.actors import engine_config
    from deploy.cli_service import add_service_arguments, service_config

    parser = argparse.ArgumentParser()
    add_service_arguments(parser)
    eager = service_config(parser.parse_args(["--enforce-eager", "--deterministic"]))
    assert eager.model.enforce_eager and engine_config(eager, "decode").enforce_eager
    assert engine_config(eager, "prefill").deterministic and engine_config(eager, "decode").deterministic
    default = service_config(parser.parse_args([]))
    assert not default.model.enforce_eager and not engine_config(default, "decode").enforce_eager
    assert not engine_config(default, "prefill").deterministic


def test_cluster_secret_is_resolved_once_and_never_shown(tmp_path):
    from deploy.config import ServiceConfig, with_cluster_secret

    made = with_cluster_secret(ServiceConfig(), None)
    assert len(made.cluster.secret or "") >= 32
    assert made.cluster.secret != with_cluster_secret(ServiceConfig(), None).cluster.secret  # random
    assert made.cluster.secret not in repr(made) and made.cluster.secret not in str(made.cluster)
    env = settings.REGISTRY["PDSERVE_CLUSTER_SECRET"].read({"PDSERVE_CLUSTER_SECRET": "from-the-environment-0123"})
    assert with_cluster_secret(ServiceConfig(), env).cluster.secret == "from-the-environment-0123"
    (tmp_path / "secret").write_text("from-a-mounted-secret-file\n")
    cfg = ServiceConfig.load(None, {"cluster.secret_file": str(tmp_path / "secret")})
    resolved = with_cluster_secret(cfg, env)  # the file wins over the environment
    assert resolved.cluster.secret == "from-a-mounted-secret-file" and resolved.cluster.secret_file is None
    assert ServiceConfig.model_validate_json(resolved.model_dump_json()).cluster.secret == resolved.cluster.secret
    with pytest.raises(ConfigError, match="cannot read the cluster secret file"):
        with_cluster_secret(ServiceConfig.load(None, {"cluster.secret_file": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match="at least 16"):
        with_cluster_secret(ServiceConfig(), "short")
    with pytest.raises(ConfigError, match="not both"):
        ServiceConfig.load(None, {"cluster.secret": "x" * 16, "cluster.secret_file": "f"})


def test_prefix_cache_flag_and_policy_reach_the_prefill_engine_and_the_router():
    import argparse

    from deploy.actors import engine_config
    from deploy.cli_service import add_service_arguments, service_config

    parser = argparse.ArgumentParser()
    add_service_arguments(parser)
    cfg = service_config(parser.parse_args(["--enable-prefix-caching", "--set", "router.policy=prefix"]))
    assert cfg.prefill.prefix_cache and cfg.router.policy == "prefix"
    assert engine_config(cfg, "prefill").enable_prefix_caching
    assert not engine_config(cfg, "decode").enable_prefix_caching  # decode.prefix_cache is its own switch
    both = service_config(parser.parse_args(["--set", "decode.prefix_cache=true"]))
    assert engine_config(both, "decode").enable_prefix_caching
    assert not engine_config(both, "prefill").enable_prefix_caching
    assert not engine_config(service_config(parser.parse_args([])), "prefill").enable_prefix_caching
    with pytest.raises(ConfigError, match="prefix_cahce"):
        ServiceConfig.load(None, {"prefill.prefix_cahce": True})
    with pytest.raises(ConfigError, match="router.policy"):
        ServiceConfig.load(None, {"router.policy": "prefixx"})


def test_tp_sizes_are_powers_of_two_and_equal_for_prefill_and_decode():
    import argparse

    from deploy.cli_service import add_service_arguments, service_config

    parser = argparse.ArgumentParser()
    add_service_arguments(parser)
    cfg = service_config(parser.parse_args(["--prefill-tp", "2", "--decode-tp", "2"]))
    assert (cfg.prefill.tp, cfg.decode.tp) == (2, 2)
    assert ServiceConfig.load(None, {}).decode.tp == 1
    with pytest.raises(ConfigError, match=r"prefill\.tp \(2\) and decode\.tp \(4\) differ"):
        ServiceConfig.load(None, {"prefill.tp": 2, "decode.tp": 4})
    with pytest.raises(ConfigError, match=r"decode\.tp: .*power of two.*got 3"):
        ServiceConfig.load(None, {"prefill.tp": 3, "decode.tp": 3})


def test_a_tp_size_the_model_does_not_split_over_is_an_error_before_the_service_starts():
    from deploy.cli_service import check_tp_fits

    with pytest.raises(ValueError, match="decode.tp 8 does not fit model 'tiny': cannot split 4 query / 2 KV"):
        check_tp_fits(ServiceConfig.load(None, {"model.name": "tiny", "prefill.tp": 8, "decode.tp": 8}))
    check_tp_fits(ServiceConfig.load(None, {"model.name": "tiny", "prefill.tp": 4, "decode.tp": 4}))
    remote = {"model.name": "tiny", "prefill.tp": 8, "decode.tp": 8, "cluster.address": "10.0.0.1:6379"}
    check_tp_fits(ServiceConfig.load(None, remote))  # the model is on the cluster's hosts: they check it


def test_kv_fault_drills_are_off_by_default_and_checked():
    from deploy.config import ConfigError, ServiceConfig

    assert not ServiceConfig.load(None).kv_transfer.faults.any
    cfg = ServiceConfig.load(None, {"kv_transfer.faults.drop": 0.01, "kv_transfer.faults.truncate": 0.02})
    assert cfg.kv_transfer.faults.any and cfg.kv_transfer.faults.truncate == 0.02
    with pytest.raises(ConfigError, match="sum to at most 1"):
        ServiceConfig.load(None, {"kv_transfer.faults.drop": 0.6, "kv_transfer.faults.delay": 0.6})
    with pytest.raises(ConfigError, match="unknown config key"):
        ServiceConfig.load(None, {"kv_transfer.faults.corrupt": 0.1})


def test_colocated_flag_makes_a_colocated_service_with_vllm_named_knobs():
    import argparse

    from deploy.actors import engine_config
    from deploy.cli_service import add_service_arguments, service_config

    parser = argparse.ArgumentParser()
    add_service_arguments(parser)
    cfg = service_config(parser.parse_args(["--colocated", "2", "--max-num-batched-tokens", "256",
                                            "--max-num-seqs", "8", "--enable-prefix-caching"]))
    assert cfg.node_counts == {"colocated": 2}
    assert cfg.prefill.num_nodes == cfg.decode.num_nodes == 0
    eng = engine_config(cfg, "colocated")
    assert (eng.max_num_batched_tokens, eng.max_num_seqs, eng.enable_prefix_caching) == (256, 8, True)
    assert ServiceConfig.model_validate_json(cfg.model_dump_json()) == cfg  # as the actors read it
    default = ServiceConfig.load(None, {"colocated.num_nodes": 1})
    assert default.colocated.max_num_batched_tokens == 512 and default.colocated.max_num_seqs == 32
    assert ServiceConfig.load(None, {}).node_counts == {"prefill": 1, "decode": 1}
    pd = service_config(parser.parse_args(["--max-num-batched-tokens", "1024"]))
    assert pd.node_counts == {"prefill": 1, "decode": 1} and engine_config(pd, "prefill").max_num_batched_tokens == 1024


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"colocated.num_nodes": 1, "prefill.num_nodes": 2}, "colocated or disaggregated"),
        ({"colocated.num_nodes": 1, "decode.num_nodes": 1}, "decode.num_nodes"),
        ({"prefill.num_nodes": 0}, "prefill.num_nodes must be >= 1"),
        ({"colocated.num_nodes": -1}, "colocated.num_nodes"),
        ({"colocated.num_nodes": 1, "colocated.max_num_batched_tokens": 0}, "colocated.max_num_batched_tokens"),
        ({"colocated.tp": 2}, "unknown config key 'colocated.tp'"),
    ],
)
def test_bad_colocated_configs_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ServiceConfig.load(None, overrides)


def test_k_policy_reaches_the_engine_config():
    from deploy.actors import engine_config

    cfg = ServiceConfig.load(None, {"spec.num_speculative_tokens": 3, "spec.k_policy": "adaptive"})
    assert ServiceConfig().spec.k_policy == "fixed"
    assert {engine_config(cfg, role).spec_k_policy for role in ("decode", "colocated")} == {"adaptive"}
    with pytest.raises(ValueError, match="k_policy"):
        ServiceConfig.load(None, {"spec.k_policy": "sometimes"})


def test_a_node_process_writes_its_own_info_lines_once(capfd):
    """deploy/actors.py node_logging: pdserve's loggers at INFO on stderr (Ray keeps it in the
    worker's .err log), one handler however often it is called; other libraries' loggers untouched."""
    import logging

    from deploy.actors import NODE_LOGGERS, node_logging

    before = {name: list(logging.getLogger(name).handlers) for name in NODE_LOGGERS}
    try:
        node_logging()
        node_logging()
        logging.getLogger("engine.runner.shapes").info("a step met shape %s", (4096, 2, 2048, True))
        logging.getLogger("urllib3").info("not ours")
        err = capfd.readouterr().err
        assert err.count("INFO engine.runner.shapes: a step met shape (4096, 2, 2048, True)") == 1
        assert "not ours" not in err
    finally:
        for name, handlers in before.items():
            logging.getLogger(name).handlers = handlers
            logging.getLogger(name).setLevel(logging.NOTSET)

from __future__ import annotations

import pytest

from weaver.config.deployment import Role, load_deployment, parse_deployment
from weaver.mux.turns import DEFAULT_SKIP_LIMIT


def model(name: str, **extra) -> dict:
    return {"name": name, "model": "smollm2-135m-instruct", **extra}


def test_embedded_default_serves_two_models_weaving():
    deployment = load_deployment()
    assert len(deployment.models) == 2
    assert {m.device for m in deployment.models} == {"cpu"}
    assert [m.role for m in deployment.models] == [Role.HOT, Role.COLD]
    (pair,) = deployment.weaving
    assert (pair.hot, pair.cold, pair.offload_ratio) == ("smollm2-hot", ["smollm2-cold"], 0.5)


def test_defaults_filled_in():
    spec = parse_deployment({"models": [model("m")]}).models[0]
    assert (spec.role, spec.device, spec.dtype, spec.max_model_len) == (
        Role.DEDICATED, "cpu", "float32", 2048)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"models": [model("m", device="gpu")]}, "models.0.device: device 'gpu' is not"),
        ({"models": [model("m", kv_cache_gibs=1)]}, "models.0.kv_cache_gibs: unknown field"),
        ({"models": [model("m", kv_cache_gib=0)]}, "models.0.kv_cache_gib"),
        ({"models": [model("bad name")]}, "must be 1-64 characters"),
        ({"models": [model("m"), model("m")]}, "repeated: ['m']"),
        ({"models": []}, "models: List should have at least 1 item"),
        ({"models": [model("m", lend_kv_gib=1)]}, "only a cold model lends memory"),
        ({"models": [model("m", cpu_cores="0-x")]}, "models.0.cpu_cores: "
         "cpu_cores '0-x': '0-x' is not a core or a range"),
        ({"models": [model("h", role="hot"), model("c", role="cold", lend_kv_gib=1)],
          "weaving": [{"hot": "h", "cold": ["x"]}]}, "weaving names 'x'"),
        ({"models": [model("h", role="hot"), model("c", role="dedicated")],
          "weaving": [{"hot": "h", "cold": ["c"]}]}, "uses 'c' as cold but its role is"),
        ({"models": [model("h", role="hot"), model("c", role="cold")],
          "weaving": [{"hot": "h", "cold": ["c"]}]}, "must lend memory"),
        ({"models": [model("h", role="hot"), model("c", role="cold", lend_kv_gib=1)],
          "weaving": [{"hot": "h", "cold": ["c"], "offload_ratio": 1.5}]}, "offload_ratio"),
    ],
)
def test_errors_name_the_field_and_the_fix(data, expected):
    with pytest.raises(ValueError, match=None) as info:
        parse_deployment(data)
    assert expected in str(info.value)


def test_weaving_pair_accepted():
    deployment = parse_deployment({
        "models": [model("h", role="hot"), model("c", role="cold", lend_kv_gib=0.5)],
        "weaving": [{"hot": "h", "cold": ["c"], "offload_ratio": 1.0}],
    })
    assert deployment.weaving[0].offload_ratio == 1.0


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_deployment(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_deployment(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_deployment(scalar)


def test_serving_block_and_model_limits():
    deployment = parse_deployment({
        "models": [model("m", max_waiting_requests=4, timeout_s=30)],
        "serving": {"max_body_bytes": 4096, "drain_grace_s": 5,
                    "restart": {"max_restarts": 2, "backoff_s": 0.5}},
    })
    spec = deployment.models[0]
    assert (spec.max_waiting_requests, spec.timeout_s) == (4, 30)
    serving = deployment.serving
    assert (serving.max_body_bytes, serving.drain_grace_s, serving.open_status_routes) == (
        4096, 5, True)
    assert (serving.restart.max_restarts, serving.restart.backoff_for(2)) == (2, 1.0)


def test_serving_errors_say_the_fix():
    with pytest.raises(ValueError, match="backoff_max_s .* must be at least backoff_s"):
        parse_deployment({"models": [model("m")],
                          "serving": {"restart": {"backoff_s": 10, "backoff_max_s": 1}}})
    with pytest.raises(ValueError, match="serving.restart.max_restart: unknown field"):
        parse_deployment({"models": [model("m")], "serving": {"restart": {"max_restart": 1}}})


def mux_deployment(**group) -> dict:
    return {"models": [model("a"), model("b"), model("c")],
            "mux": [{"name": "g", "models": ["a", "b"], **group}]}


def test_a_mux_group_binds_its_engines_to_its_cores():
    deployment = parse_deployment(mux_deployment(cpu_cores="0-1", rates={"a": 4.0}))
    group = deployment.mux_group_of("a")
    assert group is not None and group.mode == "spatial-temporal"
    assert [deployment.model(m).cpu_cores for m in "abc"] == ["0-1", "0-1", None]
    assert (group.weight("a"), group.weight("b")) == (4.0, 1.0)
    assert deployment.mux_group_of("c") is None
    # The file's default is the turn rule's (weaver/config cannot import weaver/mux).
    assert group.skip_limit == DEFAULT_SKIP_LIMIT


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (mux_deployment(models=["a", "x"]), "names 'x', which is not in models"),
        (mux_deployment(models=["a"]), "at least 2 items"),
        (mux_deployment(mode="spatial"), "'temporal' or 'spatial-temporal'"),
        (mux_deployment(rates={"c": 1.0}), "rates names ['c']"),
        (mux_deployment(rates={"a": 0}), "every rate must be > 0"),
        ({"models": [model("a", cpu_cores="0"), model("b")],
          "mux": [{"name": "g", "models": ["a", "b"], "cpu_cores": "0-1"}]},
         "remove the model's cpu_cores"),
        ({"models": [model("a", role="cold", lend_kv_gib=0.1), model("b")],
          "mux": [{"name": "g", "models": ["a", "b"]}]}, "a colocated model is dedicated"),
        ({"models": [model("a", device="cuda:0"), model("b")],
          "mux": [{"name": "g", "models": ["a", "b"]}]}, "cpu engines only so far"),
        ({"models": [model("a"), model("b"), model("c")],
          "mux": [{"name": "g", "models": ["a", "b"]}, {"name": "h", "models": ["b", "c"]}]},
         "model 'b' is in mux groups 'g' and 'h'"),
    ],
)
def test_mux_group_errors_say_the_fix(data, expected):
    with pytest.raises(ValueError) as info:
        parse_deployment(data)
    assert expected in str(info.value)


def split_deployment(**split) -> dict:
    return {"models": [model("p"), model("d"), model("e"), model("x")],
            "phase_split": [{"model": "m", "prefill": ["p"], "decode": ["d", "e"], **split}]}


def test_a_phase_split_names_its_engines_and_their_phase():
    deployment = parse_deployment(split_deployment())
    split = deployment.phase_split[0]
    assert split.engines == ["p", "d", "e"]
    assert deployment.phase_split_of("p") == (split, "prefill")
    assert deployment.phase_split_of("e") == (split, "decode")
    assert deployment.phase_split_of("x") is None


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (split_deployment(model="x"), "the name is taken by a model"),
        (split_deployment(prefill=["q"]), "names 'q', which is not in models"),
        (split_deployment(prefill=["d"]), "model 'd' is twice in phase_split 'm'"),
        (split_deployment(decode=[]), "at least 1 item"),
        ({"models": [model("p", role="cold", lend_kv_gib=0.1), model("d")],
          "phase_split": [{"model": "m", "prefill": ["p"], "decode": ["d"]}]},
         "must be a dedicated model in no mux group"),
        ({"models": [model("p", device="cuda:0"), model("d")],
          "phase_split": [{"model": "m", "prefill": ["p"], "decode": ["d"]}]},
         "vLLM's NixlConnector"),
        ({"models": [model("p", block_size=32), model("d")],
          "phase_split": [{"model": "m", "prefill": ["p"], "decode": ["d"]}]},
         "'d' has block_size None but 'p' has 32"),
    ],
)
def test_phase_split_errors_say_the_fix(data, expected):
    with pytest.raises(ValueError) as info:
        parse_deployment(data)
    assert expected in str(info.value)

"""The ingress's routing, without Ray: by model, to the group with the fewest requests in
flight; unknown models answered as vLLM's server answers them."""

from __future__ import annotations

import pytest

from weaver.cluster.routing import ModelRouter, openai_error


def test_a_model_goes_to_its_least_busy_group():
    router = ModelRouter({"chat": ["n0", "n1"], "code": ["n1"]})
    assert router.choose("code") == "n1"
    assert router.choose("chat") == "n0"  # tie: the group named first
    router.started("n0")
    assert router.choose("chat") == "n1"
    router.started("n1")
    router.started("n1")
    assert router.choose("chat") == "n0"
    router.finished("n1")
    router.finished("n1")
    router.finished("n1")  # never below zero
    assert router.in_flight("n1") == 0 and router.choose("chat") == "n1"
    assert router.choose("nope") is None and router.choose(None) is None
    router.started("n1")
    assert router.candidates("chat") == ["n0", "n1"]  # where to try next if n0 fails


def test_models_are_listed_once_as_openai_lists_them():
    listing = ModelRouter({"chat": ["n0", "n1"], "code": ["n1"]}).models_listing()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["chat", "code"]
    assert {m["object"] for m in listing["data"]} == {"model"}


def test_requests_no_group_serves_get_vllms_errors():
    status, body = openai_error("nope", ["chat"])
    assert status == 404 and "`nope` does not exist" in body["error"]["message"]
    assert openai_error(None, ["chat"])[0] == 400
    with pytest.raises(ValueError, match="needs a group"):
        ModelRouter({"chat": []})

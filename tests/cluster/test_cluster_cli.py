"""`weaver cluster` and `weaver plan --nodes` say what is wrong before anything starts."""

from __future__ import annotations

import sys

import yaml

from weaver.cli.main import main


def _cluster_file(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(
        {"models": [{"name": "chat", "model": "smollm2-135m-instruct"}]}))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"groups": [
        {"name": "n0", "deployment": "a.yaml", "resources": {"CPU": 1}}]}))
    return path


def test_up_without_ray_says_how_to_install_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray", None)  # as on a machine without the extra
    assert main(["cluster", "up", str(_cluster_file(tmp_path))]) == 2
    assert "pip install -e '.[ray]'" in caplog.text


def test_a_bad_cluster_file_is_refused_before_ray_is_touched(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ray", None)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "n0", "deployment": "nope.yaml",
                                                "resources": {"CPU": 1}}]}))
    assert main(["cluster", "up", str(path)]) == 2
    assert "group 'n0'" in caplog.text and "pip install" not in caplog.text


def test_plan_nodes_and_cluster_go_together(caplog):
    assert main(["plan", "tiny", "--nodes", "2", "--no-plot"]) == 2
    assert "--nodes N --cluster DIR" in caplog.text

"""`weaver profile` (weaver/cli/profile.py): the roofline profile and the checks made before
anything is timed."""

import argparse
import json

from weaver.cli import profile as cli
from weaver.sim.profile import Profile


def parse(argv):
    parser = argparse.ArgumentParser(prog="weaver")
    cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_profile_command_roofline(tmp_path):
    out = tmp_path / "h100.json"
    args = parse(["profile", "--device", "H100-80GB", "--shape", "llama-3-8b", "--out",
                  str(out)])
    assert args.handler(args) == 0
    assert Profile.load(out).source.startswith("roofline")


def test_retime_attention_refuses_bad_input_before_measuring(tmp_path, monkeypatch):
    from weaver.vllm_ext.engine import timing as engine_timing

    def no_timing(*args, **kwargs):
        raise AssertionError("nothing should be timed")

    monkeypatch.setattr(engine_timing, "retime_attention", no_timing)
    roofline = tmp_path / "h100.json"
    parse_args = ["profile", "--device", "H100-80GB", "--shape", "llama-3-8b", "--out",
                  str(roofline)]
    assert (args := parse(parse_args)).handler(args) == 0
    out = str(tmp_path / "out.json")
    args = parse(["profile", "--retime-attention", str(roofline), "--out", out])
    assert args.handler(args) == 2  # no --engine
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}))
    args = parse(["profile", "--retime-attention", str(roofline), "--engine", str(model_dir),
                  "--out", out])
    assert args.handler(args) == 2  # a roofline profile has no engine grid to re-time

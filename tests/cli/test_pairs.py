from __future__ import annotations

import pytest

from weaver.cli.pairs import parse_pairs


def test_pairs_are_stripped_and_the_last_repeat_wins():
    assert parse_pairs(["hot = a.yaml", "cold=b=c", "hot=d"], "--x") == {"hot": "d", "cold": "b=c"}


@pytest.mark.parametrize("text", ["novalue", "=v", "k=", " = "])
def test_a_bad_pair_names_the_flag_and_the_form(text):
    with pytest.raises(ValueError, match=r"--profile .*expected KEY=VALUE"):
        parse_pairs([text], "--profile")

"""Trace loaders and the papers' filters, on the real Azure files shipped with Weaver."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import weaver
from weaver.workloads.filters import apply_filter, burstgpt_filter, get_filter, weaver_azure_filter
from weaver.workloads.traces import (
    AZURE_SHA256,
    SHIPPED_TRACES_DIR,
    TRACES_DIR_ENV,
    file_sha256,
    load_azure,
    load_azure_file,
    load_burstgpt,
    load_trace,
    resolve_traces_dir,
    trace_file,
)


@pytest.fixture(scope="module")
def conv():
    return load_azure("azure-conv")


@pytest.fixture(scope="module")
def code():
    return load_azure("azure-code")


def _means(rows):
    return (
        float(np.mean([r.input_tokens for r in rows])),
        float(np.mean([r.output_tokens for r in rows])),
    )


def test_conv_with_weaver_filter_reproduces_paper_means(conv):
    kept = apply_filter(conv, weaver_azure_filter)
    mean_in, mean_out = _means(kept)
    assert len(kept) == 16_461
    assert mean_in == pytest.approx(749.5, abs=0.1)
    assert mean_out == pytest.approx(232.4, abs=0.1)


def test_conv_all_rows_match_readme(conv):
    mean_in, mean_out = _means(conv)
    assert len(conv) == 19_366
    assert mean_in == pytest.approx(1154.7, abs=0.1)
    assert mean_out == pytest.approx(211.1, abs=0.1)
    assert conv[0].timestamp_s == 0.0
    assert conv[-1].timestamp_s == pytest.approx(3501.7, abs=0.1)
    assert all(a.timestamp_s <= b.timestamp_s for a, b in zip(conv, conv[1:], strict=False))


def test_code_file_matches_readme(code):
    mean_in, mean_out = _means(code)
    assert len(code) == 8_819
    assert mean_in == pytest.approx(2047.8, abs=0.1)
    assert mean_out == pytest.approx(27.9, abs=0.1)
    assert code[-1].timestamp_s == pytest.approx(3435.9, abs=0.1)
    kept = apply_filter(code, weaver_azure_filter)
    mean_in, mean_out = _means(kept)
    assert len(kept) == 5_378
    assert mean_in == pytest.approx(815.3, abs=0.1)
    assert mean_out == pytest.approx(25.9, abs=0.1)


def test_traces_dir_from_env_and_crlf(tmp_path, monkeypatch):
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        b"2023-11-16 18:15:46.6805900,374,44\r\n"
        b"2023-11-16 18:15:48.1805900,1990,20\r\n"
    )
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path))
    assert resolve_traces_dir() == tmp_path
    rows = load_trace("azure-conv")
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(374, 44), (1990, 20)]
    assert rows[1].timestamp_s == pytest.approx(1.5, abs=1e-6)
    assert apply_filter(rows, get_filter("weaver-azure")) == rows[:1]


def test_the_shipped_traces_are_the_default_and_the_published_files(monkeypatch):
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    assert resolve_traces_dir() == SHIPPED_TRACES_DIR
    assert SHIPPED_TRACES_DIR.is_relative_to(Path(weaver.__file__).parent)  # package data
    for name, sha in AZURE_SHA256.items():
        assert file_sha256(SHIPPED_TRACES_DIR / name) == sha
    assert trace_file("azure-code") == SHIPPED_TRACES_DIR / "AzureLLMInferenceTrace_code.csv"


def test_a_damaged_shipped_trace_is_refused(tmp_path, monkeypatch):
    from weaver.workloads import traces

    damaged = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    damaged.write_bytes((SHIPPED_TRACES_DIR / damaged.name).read_bytes()[:-10])
    monkeypatch.setattr(traces, "SHIPPED_TRACES_DIR", tmp_path)
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="not the published trace.*reinstall"):
        load_trace("azure-conv")


def test_bad_paths_and_files_raise_value_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_traces_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown trace"):
        load_trace("sharegpt")
    with pytest.raises(ValueError, match="unknown Azure trace"):
        load_azure("azure-chat", tmp_path)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,Input,Output\n2023-11-16 18:15:46.1,1,2\n")
    with pytest.raises(ValueError, match="missing column"):
        load_azure_file(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,x,2\n")
    with pytest.raises(ValueError, match="'ContextTokens' holds 'x'"):
        load_azure_file(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n16/11/2023 18:15,1,2\n")
    with pytest.raises(ValueError, match="bad.csv:2: column 'TIMESTAMP'"):
        load_azure_file(bad)


BURSTGPT_SAMPLE = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,GPT-4,1000,999,1999,Conversation log
47,GPT-4,1000,1000,2000,API log
118,GPT-4,600,3,603,Conversation log
119,GPT-4,1200,4,1204,API log
130.5,GPT-4,150,340,490,Conversation log
"""


def test_burstgpt_loader_and_filter(tmp_path):
    path = tmp_path / "BurstGPT_sample.csv"
    path.write_text(BURSTGPT_SAMPLE)
    rows = load_burstgpt(path)
    assert len(rows) == 6
    assert rows[0].trace_model == "ChatGPT"
    assert [r.timestamp_s for r in rows] == [0, 40, 42, 113, 114, 125.5]
    kept = apply_filter(rows, burstgpt_filter)
    # ChatGPT dropped, in+out == 2000 dropped, response 3 dropped; response 4 kept.
    assert [(r.input_tokens, r.output_tokens) for r in kept] == [(1000, 999), (1200, 4), (150, 340)]
    assert load_trace(f"burstgpt:{path}") == rows


def test_burstgpt_schema_errors(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens\n1,GPT-4,3\n")
    with pytest.raises(ValueError, match="Response tokens"):
        load_burstgpt(path)
    path.write_text(BURSTGPT_SAMPLE.replace("130.5", "noon"))
    with pytest.raises(ValueError, match="'Timestamp' holds 'noon'"):
        load_burstgpt(path)
    with pytest.raises(ValueError, match="unknown filter"):
        get_filter("sharegpt")

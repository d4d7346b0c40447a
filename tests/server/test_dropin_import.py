"""`from weaver import LLM, SamplingParams` runs an existing vLLM offline script unchanged.

The same script is run twice in fresh interpreters (vLLM's engine core is spawned, so the
script needs its `__main__` guard, as any vLLM script does): once importing from vLLM and
once from Weaver. Greedy token ids must be equal. The two runs are independent processes,
so they run at the same time, each pinned to a core of its own (vLLM's default binding
would put both engines' threads on core 0, one after the other); an engine binds one
thread either way, so the tokens are those of a run alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine(seconds=70)

SCRIPT = """
import json, sys
from {package} import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(["The ocean is", "Owls can"], params, use_tqdm=False)
    print("RESULT " + json.dumps({{"llm": type(llm).__module__,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outputs]}}))
"""


def run_script(tmp_path, package: str, model_dir, core: str) -> dict:
    script = tmp_path / f"offline_{package}.py"
    script.write_text(SCRIPT.format(package=package))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=core)
    done = subprocess.run([sys.executable, str(script), str(model_dir)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def run_scripts(tmp_path, packages: tuple[str, ...], model_dir) -> list[dict]:
    """`run_script` for each package, all at once, the i-th on core i."""
    with cf.ThreadPoolExecutor(len(packages)) as pool:
        runs = [pool.submit(run_script, tmp_path, package, model_dir, str(core))
                for core, package in enumerate(packages)]
        return [run.result() for run in runs]


def test_weaver_import_is_a_drop_in_for_vllm_offline(tmp_path):
    from weaver.models.registry import prepare_model

    model_dir = prepare_model("tiny-llama-a")
    with_vllm, with_weaver = run_scripts(tmp_path, ("vllm", "weaver"), model_dir)
    assert with_weaver["llm"].startswith("vllm.")  # the very class, not a look-alike
    assert [len(t) for t in with_weaver["tokens"]] == [8, 8]
    assert with_weaver["tokens"] == with_vllm["tokens"]

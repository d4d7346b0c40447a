"""The weaving runtime is Weaver's own: it imports no vLLM (the backend hands it tensors and
an AttentionOps; docs/architecture.md, "The weaving path")."""

from __future__ import annotations

import subprocess
import sys


def test_the_weaving_runtime_imports_without_vllm():
    code = (
        "import sys\n"
        "import weaver.weaving.hot, weaver.weaving.cold, weaver.weaving.poll_points\n"
        "import weaver.weaving.plan, weaver.weaving.placement\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

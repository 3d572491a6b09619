"""The scaffolding the services share stands on no model runtime: the orchestrator runs
no model, and a drafter's or verifier's servicer is the same whatever runs its passes."""

import subprocess
import sys

SHARED = ["specdec.server", "specdec.session_service", "specdec.sessions", "specdec.flags", "specdec.security",
          "specdec.errors", "specdec.logs", "specdec.tracing", "specdec.metrics"]


def test_the_shared_scaffolding_imports_no_runtime():
    code = (f"import sys; import {', '.join(SHARED)}; "
            "print(sorted({m for m in sys.modules if m.startswith('specdec.runtime') or m == 'torch'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout

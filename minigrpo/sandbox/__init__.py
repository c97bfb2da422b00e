"""Running model-written code where it cannot touch the tests, the machine, or the verdict.

runner.py starts the confined child (confine.py) and reads its verdict; `run_tests` is what a reward calls:

    from minigrpo.sandbox import run_tests
"""

from minigrpo.sandbox.runner import SandboxError, Verdict, layers, run_tests

__all__ = ["SandboxError", "Verdict", "layers", "run_tests"]

"""The vLLM tests run only where vLLM is installed (scripts/vllm_test.sh builds that environment).

vLLM's engine runs in the test process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the plugin's hooks
and observers are reachable; its CPU KV cache is 1 GiB (vLLM's CPU default takes most of the
machine's memory).
"""
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

try:
    from vllm import LLM  # noqa: F401  (the engine itself: a bare `import vllm` can find a folder)
except ImportError:
    collect_ignore_glob = ["test_*.py"]


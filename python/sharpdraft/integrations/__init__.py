"""Integrations with serving engines: `sharpdraft.integrations.vllm` (a vLLM general plugin).

The top layer of the package: it may import any other layer, none imports it.
"""

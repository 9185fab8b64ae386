"""vLLM instrumentation: the KV-cache manager shim, recipes from vLLM config, a no-model driver.

Importing this package does not import vLLM; `shim` and `recipe` touch vLLM only through the
objects they are given, and `driver` needs vLLM installed.
"""

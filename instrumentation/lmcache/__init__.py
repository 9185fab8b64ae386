"""LMCache instrumentation: the shim, its enablement and the CPU stand-ins it is tested with."""

"""kvtrace.instrumentation.sinks"""

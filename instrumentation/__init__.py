"""kvtrace.instrumentation"""

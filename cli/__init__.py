"""kvtrace.cli"""

"""kvtrace.collector"""

"""kvtrace.dashboards"""

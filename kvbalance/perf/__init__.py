"""kvbalance.perf"""

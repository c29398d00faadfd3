"""kvbalance.workloads"""

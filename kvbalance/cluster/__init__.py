"""kvbalance.cluster"""

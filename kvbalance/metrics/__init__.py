"""kvbalance.metrics"""

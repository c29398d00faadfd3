"""kvbalance.theory"""

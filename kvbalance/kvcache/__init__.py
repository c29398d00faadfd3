"""kvbalance.kvcache"""

"""kvbalance.offline"""
